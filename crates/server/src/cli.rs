//! `metrale-serve`'s options that take more than a number, spelled and
//! resolved as the `metrale` subcommands do: one definition, in
//! [`metrale::flags`].

pub use metrale::flags::{ArithDType, KvDType, PrefixCacheArgs, StateDType, parse_memory};
