//! What confluo's command line, benchmarks and tests need around PostgreSQL: the server to
//! run against (the configured one when it answers, else a throwaway one: a local server
//! from the machine's own binaries, or a container) and databases of their own on it.
//!
//! Not published: the command line (`cli/`) and the benchmarks (`benches/`) depend on it,
//! so that neither a library user nor a command carries a copy of it.
#![forbid(unsafe_code)]

pub mod connections;
pub mod server;

pub use connections::ConnectionRoom;
pub use server::{existing_database, fresh_database, Server};
