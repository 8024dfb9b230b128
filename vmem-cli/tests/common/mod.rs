//! What every test of the `vmem` command needs: the binary run with arguments, its output as
//! text, the bundled traces.

use std::path::Path;
use std::process::{Command, Output};

/// Runs the `vmem` binary with `args`, without the caller's `VMEM_BACKEND`.
pub fn vmem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmem"))
        .args(args)
        .env_remove("VMEM_BACKEND")
        .output()
        .expect("run vmem")
}

/// Output bytes as text (invalid UTF-8 replaced).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The path of the bundled trace `name` (in `vmem-cli/data/traces`).
pub fn trace(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces")
        .join(name)
        .display()
        .to_string()
}
