//! What the pool's tests share: a scratch directory, and tenant processes (this test binary
//! run again as the ignored test `tenant_process`, which speaks a line protocol).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use vmem::backend::{Backend, HostBackend, KIB64};
use vmem_pool::{Floor, Ledger, Limit, PoolBackend};

/// A directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("vmem-pool-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tenant process.
pub struct TenantProc {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// Starts `tenant_process` of the test binary `exe` as tenant `name` of `ledger`, in `mode`
/// (`commands`: answers commands; `churn`: creates and releases pages until killed; `load`:
/// the same with a pause between rounds).
pub fn spawn(ledger: &Path, name: &str, limit: Option<&str>, mode: &str) -> TenantProc {
    spawn_with(ledger, name, limit, mode, &[])
}

/// [`spawn`] with more environment: `VMEM_POOL_TEST_FLOOR` (the tenant's floor at join),
/// `VMEM_POOL_TEST_FLOOR_OF` (in `churn` mode, a tenant whose floor it flips every round).
pub fn spawn_with(
    ledger: &Path,
    name: &str,
    limit: Option<&str>,
    mode: &str,
    env: &[(&str, &str)],
) -> TenantProc {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "tenant_process",
        "--ignored",
        "--nocapture",
        "-q",
        "--test-threads=1",
    ])
    .env("VMEM_POOL_TEST_LEDGER", ledger)
    .env("VMEM_POOL_TEST_NAME", name)
    .env("VMEM_POOL_TEST_MODE", mode)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    if let Some(l) = limit {
        cmd.env("VMEM_POOL_TEST_LIMIT", l);
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    TenantProc {
        child,
        stdin,
        stdout,
    }
}

impl TenantProc {
    /// The next protocol line (those starting with '@'), without the '@'.
    pub fn line(&mut self) -> String {
        loop {
            let mut l = String::new();
            let n = self.stdout.read_line(&mut l).unwrap();
            assert!(n > 0, "tenant process ended early");
            if let Some(rest) = l.trim_end().strip_prefix('@') {
                return rest.to_string();
            }
        }
    }

    /// Sends a command, returns its answer.
    pub fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }

    /// `grow N`: how many pages it got, then its usage.
    pub fn grow(&mut self, pages: usize) -> (usize, u64) {
        let a = self.ask(&format!("grow {pages}"));
        let v: Vec<u64> = a.split(' ').map(|x| x.parse().unwrap()).collect();
        (v[0] as usize, v[1])
    }

    /// `free N`: its usage after.
    pub fn free(&mut self, pages: usize) -> u64 {
        self.ask(&format!("free {pages}")).parse().unwrap()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Ends it with SIGKILL and waits for it.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Asks it to leave and waits for a clean exit.
    pub fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let st = self.child.wait().unwrap();
        assert!(st.success(), "{st}");
    }
}

impl Drop for TenantProc {
    /// A test that fails leaves no tenant process behind (a clean `exit` or `kill` has
    /// already reaped it: then this does nothing).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The page size the tenant processes use.
pub const PAGE: u64 = KIB64;

/// The body of `tenant_process`: join, say `@ready`, then serve the mode.
pub fn tenant_main() {
    let ledger = std::env::var("VMEM_POOL_TEST_LEDGER").expect("run by the pool tests only");
    let name = std::env::var("VMEM_POOL_TEST_NAME").unwrap();
    let mode = std::env::var("VMEM_POOL_TEST_MODE").unwrap();
    let limit: Option<Limit> = std::env::var("VMEM_POOL_TEST_LIMIT")
        .ok()
        .map(|l| l.parse().unwrap());
    let floor: Floor =
        std::env::var("VMEM_POOL_TEST_FLOOR").map_or(Floor::NONE, |f| f.parse().unwrap());
    let ledger = Arc::new(Ledger::open(&ledger).unwrap());
    let tenant = ledger.join_with_floor(&name, limit, floor).unwrap();
    // In churn mode, the floor of this tenant to change on every round (a change cut short by
    // a kill must be repaired, not leave the ledger corrupt).
    let floor_of = std::env::var("VMEM_POOL_TEST_FLOOR_OF").ok();
    let mut round = 0u64;
    let host: Arc<dyn Backend> = Arc::new(HostBackend::new().unwrap());
    let backend = PoolBackend::new(host, tenant);
    let mut pages = Vec::new();
    let out = std::io::stdout();
    println!("@ready");
    match mode.as_str() {
        "churn" | "load" => loop {
            if mode == "load" {
                // Load beside the tests' work, leaving them CPU on a 2-core machine.
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            // Never stops on its own: the test kills it at a random moment.
            while pages.len() < 8 {
                match backend.create_page(PAGE) {
                    Ok(p) => pages.push(p),
                    Err(vmem::VmemError::OutOfMemory { .. }) => break,
                    // Any other error ends the process, which the tests see.
                    Err(e) => panic!("{e}"),
                }
            }
            while let Some(p) = pages.pop() {
                backend.release_page(p).unwrap();
            }
            if let Some(other) = &floor_of {
                round += 1;
                let f = Floor::Bytes(PAGE * 4 * (round % 2));
                backend.tenant().ledger().set_floor(other, f).unwrap();
            }
        },
        "commands" => {
            for line in std::io::stdin().lines() {
                let line = line.unwrap();
                let mut w = line.split(' ');
                let (cmd, n) = (
                    w.next().unwrap(),
                    w.next().map(|n| n.parse::<usize>().unwrap()),
                );
                match cmd {
                    "grow" => {
                        let mut got = 0;
                        for _ in 0..n.unwrap() {
                            match backend.create_page(PAGE) {
                                Ok(p) => {
                                    pages.push(p);
                                    got += 1;
                                }
                                Err(vmem::VmemError::OutOfMemory { .. }) => break,
                                Err(e) => panic!("{e}"),
                            }
                        }
                        println!("@{got} {}", backend.tenant().usage());
                    }
                    "free" => {
                        for _ in 0..n.unwrap() {
                            if let Some(p) = pages.pop() {
                                backend.release_page(p).unwrap();
                            }
                        }
                        println!("@{}", backend.tenant().usage());
                    }
                    "over" => println!("@{}", backend.tenant().over_limit().unwrap_or(0)),
                    "exit" => break,
                    other => panic!("unknown command {other}"),
                }
                let _ = out.lock().flush();
            }
            while let Some(p) = pages.pop() {
                backend.release_page(p).unwrap();
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

/// A small tmpfs mounted on a fresh directory, unmounted (and the directory removed) on drop:
/// a filesystem that fills up. `None` where this process may not mount (not root, or no
/// `CAP_SYS_ADMIN` in a container), with the reason on stderr.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn mount(tag: &str, size: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("vmem-tmpfs-{tag}-{}", std::process::id()));
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

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Mounts it again read-only (what an operator's read-only /dev/shm or a container's
    /// read-only root is to a ledger), retrying for up to 5 s while the kernel calls it busy:
    /// a child another test forked (to run `mount`) holds a copy of every descriptor open
    /// then, a file open for writing among them, until it execs.
    #[allow(dead_code)] // used by some of the test binaries that include this module
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

    /// Waits (up to 5 s) until every block of it is free again.
    #[allow(dead_code)] // used by some of the test binaries that include this module
    pub fn wait_until_empty(&self) {
        let c = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
        let start = std::time::Instant::now();
        loop {
            let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
            // SAFETY: a NUL-terminated path and a writable statvfs, both alive for the call.
            assert_eq!(unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) }, 0);
            // SAFETY: statvfs succeeded and filled it.
            let st = unsafe { st.assume_init() };
            if st.f_bfree == st.f_blocks {
                return;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "{} blocks of {} still used",
                st.f_blocks - st.f_bfree,
                st.f_blocks
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
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
