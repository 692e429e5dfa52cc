//! Newtype ids, so that a block index can never be passed where a slot is meant.

use std::fmt;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw index, for indexing tables.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_newtype!(
    /// A running sequence (one request's token stream).
    SeqId(u64), "seq#"
);
id_newtype!(
    /// A block of the paged KV cache.
    BlockId(u32), "block#"
);
id_newtype!(
    /// A slot of the SSM state pool.
    SlotId(u32), "slot#"
);
id_newtype!(
    /// A decoder layer.
    LayerIdx(u32), "layer#"
);
