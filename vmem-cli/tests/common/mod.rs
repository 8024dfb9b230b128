//! What every test of the `vmem` command needs: the binary run with arguments, its output as
//! text, the bundled traces.

use std::path::{Path, PathBuf};
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

/// A scratch file with `content`, removed at drop.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(name: &str, content: &[u8]) -> Self {
        let dir = std::env::temp_dir().join(format!("vmem-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        Scratch(p)
    }
    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Asserts that `vmem` refused `case` as bad input: exit status 1, nothing on stdout, and on
/// stderr an error naming each of `wants`, not a panic.
#[allow(dead_code)] // prefix.rs refuses nothing
pub fn assert_refused(out: &Output, case: &str, wants: &[&str]) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{case}: {err}");
    assert!(
        out.stdout.is_empty(),
        "{case} printed {}",
        text(&out.stdout)
    );
    assert!(err.starts_with("error: "), "{case}: {err}");
    for want in wants {
        assert!(err.contains(want), "{case}: no {want:?} in {err}");
    }
    assert!(!err.contains("panicked"), "{case}: {err}");
}

/// A scratch directory removed on drop (`vmem-cli-<tag>-<pid>` under the temporary directory).
#[allow(dead_code)] // the pool tests' only
pub struct Dir(pub PathBuf);

#[allow(dead_code)]
impl Dir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("vmem-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `vmem pool --ledger LEDGER ARGS...`.
#[allow(dead_code)]
pub fn pool(ledger: &Path, args: &[&str]) -> Output {
    let l = ledger.to_str().unwrap();
    vmem(&[&["pool", "--ledger", l][..], args].concat())
}

/// Asserts exit status 0 (stderr shown otherwise); returns stdout as text.
#[allow(dead_code)]
pub fn ok(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    text(&out.stdout)
}

/// A small tmpfs mounted on a fresh directory, unmounted (and the directory removed) on drop:
/// a filesystem that fills up. `None` where this process may not mount (not root, or no
/// `CAP_SYS_ADMIN` in a container), with the reason on stderr.
#[allow(dead_code)]
pub struct Tmpfs(pub PathBuf);

#[allow(dead_code)]
impl Tmpfs {
    pub fn mount(tag: &str, size: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("vmem-cli-tmpfs-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&dir)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Tmpfs(dir)),
            other => {
                let _ = std::fs::remove_dir(&dir);
                eprintln!(
                    "SKIPPED: cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {:?}",
                    other.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
                );
                None
            }
        }
    }

    /// Mounts it again read-only (what an operator's read-only /dev/shm or a container's
    /// read-only root is to a ledger), retrying for up to 5 s while the kernel calls it busy:
    /// a child another test forked (to run `mount`) holds a copy of every descriptor open
    /// then, a file open for writing among them, until it execs.
    pub fn remount_read_only(&self) {
        let start = std::time::Instant::now();
        loop {
            let out = Command::new("mount")
                .args(["-o", "remount,ro"])
                .arg(&self.0)
                .output()
                .unwrap();
            if out.status.success() {
                return;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The names in it.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}
