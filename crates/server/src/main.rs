//! `metrale-serve`: the same server as `metrale serve`
//! ([`metrale::server::cli`]).

fn main() -> std::process::ExitCode {
    metrale::server::cli::main(std::env::args_os())
}
