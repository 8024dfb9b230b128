//! Runs every vMem ioctl against a loaded, patched nvidia-uvm with **no GPU** (the QEMU boot
//! test of `scripts/driver-vm-test.sh` runs it as the VM's init payload, with the module
//! loaded with `uvm_enable_builtin_tests=1`): detection, the argument checks of every
//! command, the ABI handshake both ways (every version-2 number refused), the module's
//! shared-page bookkeeping test, the caller's-mm check after fork, and file close. Each check prints `ok` or `FAIL`; the exit status is the
//! number of failures (0: all passed).
//!
//! ```sh
//! cargo run -p uvm-ioctl --example vm_check     # on a machine with the patched module loaded
//! ```
//!
//! With no GPU registered on the file, commands that pass their argument checks end in
//! `NV_ERR_INVALID_DEVICE` (reserve, create) or "not found" (map, unmap, release, free): what
//! is checked is that each is refused for the right reason, with the right code.

use std::process::ExitCode;
use uvm_ioctl::bindings::*;
use uvm_ioctl::{detect, DriverStatus, MapBatch, UnmapBatch, UvmError, UvmFile};

const OK: u32 = 0x0;
const ILLEGAL_ACTION: u32 = 0x16;
const INVALID_ADDRESS: u32 = 0x1e;
const INVALID_ARGUMENT: u32 = 0x1f;
const INVALID_DEVICE: u32 = 0x26;
const NOT_SUPPORTED: u32 = 0x56;
const OBJECT_NOT_FOUND: u32 = 0x57;

struct Checks {
    failed: u32,
}

impl Checks {
    fn check(&mut self, what: &str, pass: bool, got: impl std::fmt::Debug) {
        if pass {
            println!("vm_check: ok   {what}: {got:?}");
        } else {
            println!("vm_check: FAIL {what}: {got:?}");
            self.failed += 1;
        }
    }

    /// The command ran (ioctl returned 0) and the driver answered `want`.
    fn status(&mut self, what: &str, r: Result<(), UvmError>, want: u32) {
        let got = match &r {
            Ok(()) => OK,
            Err(UvmError::Status { status, .. }) => *status,
            Err(_) => u32::MAX,
        };
        self.check(
            &format!("{what} -> {}", uvm_ioctl::status_name(want)),
            got == want,
            r,
        );
    }
}

fn main() -> ExitCode {
    let mut c = Checks { failed: 0 };
    let gpu = [0x42u8; 16]; // no such GPU on this file

    // Detection through the crate's own path: a fresh, uninitialised file and the query.
    let status = detect();
    c.check(
        "detect() says patched, this crate's version",
        matches!(&status, DriverStatus::Patched { info, .. } if info.version == UVM_VMEM_VERSION
            && info.page_sizes == [65536, 131072, 262144, 2097152]
            && info.range_align == 2 << 20),
        status.describe(),
    );

    let raw = match UvmFile::open() {
        Ok(f) => f,
        Err(e) => {
            println!("vm_check: FAIL open /dev/nvidia-uvm: {e}");
            return ExitCode::from(1);
        }
    };
    // Before UVM_INITIALIZE the file has no VA space: the init check refuses the commands.
    c.check(
        "has_va_space() on an uninitialised file",
        matches!(raw.has_va_space(), Ok(false)),
        raw.has_va_space(),
    );
    c.status(
        "reserve on an uninitialised file",
        raw.reserve(&gpu, 2 << 20).map(drop),
        ILLEGAL_ACTION,
    );
    c.status("initialize", raw.initialize(), OK);
    c.check(
        "has_va_space() after initialize",
        matches!(raw.has_va_space(), Ok(true)),
        raw.has_va_space(),
    );
    let f = raw;

    // Argument checks the driver makes itself (ioctl() skips the crate's own checks).
    let reserve = |length: u64, flags: u32| {
        let mut p = UVM_VMEM_RESERVE_PARAMS {
            gpuUuid: NvProcessorUuid { uuid: gpu },
            length,
            flags,
            ..Default::default()
        };
        f.ioctl(&mut p)
    };
    c.status("reserve length 0", reserve(0, 0), INVALID_ARGUMENT);
    c.status(
        "reserve length 2M + 1",
        reserve((2 << 20) + 1, 0),
        INVALID_ARGUMENT,
    );
    c.status(
        "reserve length near 2^64",
        reserve(u64::MAX - (2 << 20) + 2, 0),
        INVALID_ARGUMENT,
    );
    c.status("reserve flags 1", reserve(2 << 20, 1), INVALID_ARGUMENT);
    c.status(
        "reserve on an unknown GPU",
        reserve(2 << 20, 0),
        INVALID_DEVICE,
    );

    let create = |page_size: u64, flags: u32| {
        let mut p = UVM_VMEM_CREATE_PARAMS {
            gpuUuid: NvProcessorUuid { uuid: gpu },
            pageSize: page_size,
            flags,
            ..Default::default()
        };
        f.ioctl(&mut p)
    };
    for bad in [0, 4096, 65537, 3 << 16, 1 << 20, 4 << 20] {
        c.status(
            &format!("create page size {bad}"),
            create(bad, 0),
            INVALID_ARGUMENT,
        );
    }
    c.status("create flags 1", create(65536, 1), INVALID_ARGUMENT);
    for good in [65536, 131072, 262144, 2 << 20] {
        c.status(
            &format!("create {good} on an unknown GPU"),
            create(good, 0),
            INVALID_DEVICE,
        );
    }

    let map = |base: u64, handle: u64, flags: u32| {
        let mut p = UVM_VMEM_MAP_PARAMS {
            base,
            handle,
            flags,
            ..Default::default()
        };
        f.ioctl(&mut p)
    };
    c.status("map flags 1", map(2 << 20, 1, 1), INVALID_ARGUMENT);
    // v3's MAP reports the page's map count; a refused map must report 0, not leave what
    // the caller passed in.
    {
        let mut p = UVM_VMEM_MAP_PARAMS {
            base: 2 << 20,
            handle: 3,
            mapCount: 0xdead,
            ..Default::default()
        };
        let r = f.ioctl(&mut p);
        c.status("map of an unknown handle (v3 struct)", r, OBJECT_NOT_FOUND);
        c.check("refused map: mapCount 0", p.mapCount == 0, p.mapCount);
    }
    for handle in [0, 1, 0x7fff_ffff, 0x8000_0000, u64::MAX] {
        c.status(
            &format!("map handle {handle:#x}"),
            map(2 << 20, handle, 0),
            OBJECT_NOT_FOUND,
        );
    }

    let unmap = |base: u64, length: u64, flags: u32| {
        let mut p = UVM_VMEM_UNMAP_PARAMS {
            base,
            length,
            flags,
            ..Default::default()
        };
        let r = f.ioctl(&mut p);
        (r, p.unmapped)
    };
    for (what, base, length, flags, want) in [
        ("unmap length 0", 2 << 20, 0, 0, INVALID_ARGUMENT),
        ("unmap flags 1", 2 << 20, 65536, 1, INVALID_ARGUMENT),
        ("unmap misaligned", 4096, 65536, 0, INVALID_ARGUMENT),
        (
            "unmap base + length wraps",
            u64::MAX - 65535,
            1 << 17,
            0,
            INVALID_ARGUMENT,
        ),
        (
            "unmap of nothing mapped",
            2 << 20,
            65536,
            0,
            INVALID_ADDRESS,
        ),
    ] {
        let (r, unmapped) = unmap(base, length, flags);
        c.status(what, r, want);
        c.check(
            &format!("{what}: nothing unmapped"),
            unmapped == 0,
            unmapped,
        );
    }

    let release = |handle: u64, flags: u32| {
        let mut p = UVM_VMEM_RELEASE_PARAMS {
            handle,
            flags,
            ..Default::default()
        };
        f.ioctl(&mut p)
    };
    c.status("release flags 2", release(1, 2), INVALID_ARGUMENT);
    c.status("release handle 0", release(0, 0), OBJECT_NOT_FOUND);
    c.status("release unknown handle", release(7, 1), OBJECT_NOT_FOUND);

    let free = |base: u64, flags: u32| {
        let mut p = UVM_VMEM_FREE_PARAMS {
            base,
            flags,
            ..Default::default()
        };
        f.ioctl(&mut p)
    };
    c.status("free flags 1", free(2 << 20, 1), INVALID_ARGUMENT);
    c.status("free of no range", free(2 << 20, 0), INVALID_ADDRESS);

    // Batches: count bounds, a bad user pointer, an unknown handle; nothing may be done.
    let entries = [UVM_VMEM_BATCH_ENTRY {
        base: 2 << 20,
        handle: 5,
    }];
    let batch = |ptr: u64, count: u32, flags: u32| UVM_VMEM_BATCH_PARAMS {
        entries: ptr,
        count,
        flags,
        ..Default::default()
    };
    let good_ptr = entries.as_ptr() as u64;
    for (what, p, want) in [
        ("count 0", batch(good_ptr, 0, 0), INVALID_ARGUMENT),
        ("count 513", batch(good_ptr, 513, 0), INVALID_ARGUMENT),
        ("flags 1", batch(good_ptr, 1, 1), INVALID_ARGUMENT),
        ("entries at address 8", batch(8, 1, 0), INVALID_ADDRESS),
        ("an unknown handle", batch(good_ptr, 1, 0), OBJECT_NOT_FOUND),
    ] {
        let mut m = MapBatch(p);
        let r = f.ioctl(&mut m);
        c.status(&format!("map batch, {what}"), r, want);
        c.check(
            &format!("map batch, {what}: done 0"),
            m.0.done == 0,
            m.0.done,
        );
        let mut u = UnmapBatch(p);
        let want = if want == OBJECT_NOT_FOUND {
            INVALID_ADDRESS
        } else {
            want
        };
        let r = f.ioctl(&mut u);
        c.status(&format!("unmap batch, {what}"), r, want);
        c.check(
            &format!("unmap batch, {what}: done 0"),
            u.0.done == 0,
            u.0.done,
        );
    }

    // ABI, the module's side: numbers of the family it does not know (a struct of another
    // size, the version-1 numbers, every version-2 number: v3 changed MAP's struct and
    // meaning, and carries the version in every number) are refused with EPROTO before
    // anything is copied.
    let v2 = |size: u32, nr: u32| UVM_VMEM_IOCTL_BASE | (size << 4) | nr;
    for (what, cmd) in [
        ("version-1 MAP number", UVM_VMEM_IOCTL_BASE + 4),
        ("version-2 RESERVE", v2(40, 2)),
        ("version-2 CREATE", v2(40, 3)),
        ("version-2 MAP", v2(24, 4)),
        ("version-2 UNMAP", v2(32, 5)),
        ("version-2 RELEASE", v2(16, 6)),
        ("version-2 FREE", v2(16, 7)),
        ("version-2 MAP_BATCH", v2(24, 8)),
        ("version-2 UNMAP_BATCH", v2(24, 9)),
        (
            "RESERVE with a 48-byte struct",
            UVM_VMEM_IOCTL_V | (48 << 4) | 2,
        ),
        (
            "version-4 RESERVE",
            v2(40, 2) | (4 << UVM_VMEM_VERSION_SHIFT),
        ),
        ("command 15", UVM_VMEM_IOCTL_V | (24 << 4) | 15),
    ] {
        let mut buf = [0xa5u8; 64];
        // SAFETY: `buf` is 64 writable bytes, more than any number here could name; the
        // module must not touch it at all (checked below).
        let ret = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                cmd as libc::c_ulong,
                buf.as_mut_ptr(),
            )
        };
        let errno = std::io::Error::last_os_error().raw_os_error();
        c.check(
            &format!("{what} ({cmd:#x}) -> EPROTO, buffer untouched"),
            ret == -1 && errno == Some(libc::EPROTO) && buf.iter().all(|&b| b == 0xa5),
            (ret, errno),
        );
    }
    // ABI, the crate's side: the query is frozen, and the crate checks the version it reads.
    c.check(
        "query() accepts this module's version",
        matches!(f.query(), Ok(ref i) if i.version == UVM_VMEM_VERSION),
        f.query().map(|i| i.version),
    );

    // Shared pages (v3): the module's bookkeeping test, through the functions its ioctls
    // use (a page at three addresses in two ranges, refusals that leave counts as they
    // were, unmapping one mapping of three, release refused while mapped). With no GPU no
    // page can be created, so this is the only way the bookkeeping runs here.
    c.check(
        "self test: sharing bookkeeping, every step passed",
        matches!(f.self_test(), Ok(None)),
        f.self_test(),
    );
    {
        let mut p = UVM_VMEM_SELF_TEST_PARAMS {
            flags: 1,
            ..Default::default()
        };
        c.status("self test flags 1", f.ioctl(&mut p), INVALID_ARGUMENT);
    }

    // The caller's mm: a forked child may not act on its parent's VA space.
    // SAFETY: this process is single-threaded here; the child only issues one ioctl and
    // exits with _exit, touching nothing the fork could have left inconsistent.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut p = UVM_VMEM_RESERVE_PARAMS {
            gpuUuid: NvProcessorUuid { uuid: gpu },
            length: 2 << 20,
            ..Default::default()
        };
        let code = match f.ioctl(&mut p) {
            Err(UvmError::Status { status, .. }) if status == NOT_SUPPORTED => 0,
            _ => 1,
        };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut wstatus = 0;
    // SAFETY: waits for the child forked above.
    let waited = unsafe { libc::waitpid(pid, &mut wstatus, 0) };
    c.check(
        "forked child's reserve -> NV_ERR_NOT_SUPPORTED",
        waited == pid && libc::WIFEXITED(wstatus) && libc::WEXITSTATUS(wstatus) == 0,
        wstatus,
    );

    // Close: the VA space is destroyed and the vMem state with it (the kernel log is
    // checked for leaks after the module is unloaded).
    drop(f);
    println!("vm_check: {} failed", c.failed);
    ExitCode::from(c.failed.min(255) as u8)
}
