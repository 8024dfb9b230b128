//! The ledger file: created in full under a temporary name and linked into place, opened
//! without following links, and checked (type, owner and mode, header, size, slots) before
//! it is used.

use crate::access;
use crate::config::PoolConfig;
use crate::error::{PoolError, Result};
use crate::layout::{self, h, HEADER_WORDS, SLOT_WORDS};
use crate::ledger::{now_secs, os, Ledger};
use crate::sys::{self, Mapping};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

/// What a path that is not a regular file is, in words.
fn describe(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link (give the ledger's own path)"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() || ft.is_block_device() {
        "a device"
    } else if ft.is_file() {
        "a file"
    } else {
        "not a regular file"
    }
}

/// The bytes of a new ledger of `config`, created at `created` (Unix seconds): the sealed
/// header, then every slot free and sealed.
fn new_file(config: &PoolConfig, created: u64) -> Vec<u8> {
    let words: Vec<AtomicU64> = (0..layout::file_len(config.slots) / 8)
        .map(|_| AtomicU64::new(0))
        .collect();
    let header = [
        layout::MAGIC,
        layout::VERSION,
        config.slots,
        SLOT_WORDS as u64,
        config.total,
        config.default_limit,
        created,
    ];
    for (w, v) in words.iter().zip(header) {
        w.store(v, Relaxed);
    }
    words[h::SEAL].store(layout::header_seal(&words), Relaxed);
    for slot in words[HEADER_WORDS..].chunks(SLOT_WORDS) {
        slot[layout::s::SEAL].store(layout::slot_seal(slot), Relaxed);
    }
    words
        .iter()
        .flat_map(|w| w.load(Relaxed).to_le_bytes())
        .collect()
}

/// Why a ledger [`Ledger::open_read_only`] opened is read-only.
const READ_ONLY_ASKED: &str = "opened for reading only";
/// Why a ledger [`Ledger::open`] opened is read-only.
const READ_ONLY_FILESYSTEM: &str = "its filesystem is mounted read-only";

/// Removes the temporary file a ledger is built in, whatever happens.
struct Unlink<'a>(&'a Path);

impl Drop for Unlink<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

impl Ledger {
    /// Creates a ledger at `path`, which must not exist: owner-only (mode 0600), or 0660 and
    /// given to the configured group. The file is written in full under a temporary name in
    /// the same directory and then linked into place, so no process ever opens half a
    /// ledger, and nothing at `path` is ever replaced.
    pub fn create(path: impl AsRef<Path>, config: &PoolConfig) -> Result<Ledger> {
        let path = path.as_ref();
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            return Err(PoolError::AlreadyExists {
                path: path.into(),
                what: describe(meta.file_type()).into(),
            });
        }
        let name = path.file_name().ok_or_else(|| {
            PoolError::InvalidSetting(format!("{} names no file", crate::error::shown(path)))
        })?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(PoolError::InvalidSetting(format!(
                "{} is not a directory: a ledger is created in an existing one",
                crate::error::shown(dir)
            )));
        }
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = dir.join(format!(
            ".{}.{}.{nanos}.tmp",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = File::from(sys::open(&tmp, Some(0o600)).map_err(os("create", &tmp))?);
        let _cleanup = Unlink(&tmp);
        let mode = match config.group {
            Some(gid) => {
                sys::fchgrp(file.as_fd(), gid).map_err(os("chgrp", &tmp))?;
                0o660
            }
            None => 0o600,
        };
        sys::fchmod(file.as_fd(), mode).map_err(os("chmod", &tmp))?;
        // Written whole, not sized sparse and written through a mapping: on a full filesystem
        // a store into a hole of a mapping is a SIGBUS, while a write is ENOSPC.
        let contents = new_file(config, now_secs());
        file.write_all_at(&contents, 0).map_err(os("write", &tmp))?;
        match sys::link(&tmp, path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(PoolError::AlreadyExists {
                    path: path.into(),
                    what: "made by another process meanwhile".into(),
                })
            }
            Err(e) => return Err(os("link", path)(e)),
        }
        Self::from_file(path, file, None)
    }

    /// Removes the ledger's file, if no tenant is in the pool (dead ones are reaped first;
    /// else [`PoolError::InUse`]) and its path still names this ledger's file (else
    /// [`PoolError::NotALedger`]): what undoes a [`Ledger::create`] whose result could not be
    /// reported. Under the header's lock, so no tenant joins meanwhile through the path.
    pub fn remove_unused(self) -> Result<()> {
        let admin = self.admin()?;
        self.check(&admin)?;
        self.reap_locked(&admin)?;
        let tenants = self.tenants();
        if tenants > 0 {
            return Err(PoolError::InUse {
                path: self.path().into(),
                tenants,
            });
        }
        let ours = sys::fstat(self.file().as_fd()).map_err(os("fstat", self.path()))?;
        let there = std::fs::symlink_metadata(self.path()).map_err(os("stat", self.path()))?;
        use std::os::unix::fs::MetadataExt;
        if (there.dev(), there.ino()) != ours.id {
            return Err(PoolError::NotALedger {
                path: self.path().into(),
                why: "another file took its place: left as it is".into(),
            });
        }
        std::fs::remove_file(self.path()).map_err(os("remove", self.path()))?;
        drop(admin);
        Ok(())
    }

    /// Opens the ledger at `path`, checking that it is a regular file this user may use
    /// (its owner, or a member of the group it is granted to) and that it is consistent.
    /// Nothing is written. On a filesystem mounted read-only it is opened read-only
    /// ([`Ledger::open_read_only`]): its status can be read, and every change is refused
    /// with [`PoolError::ReadOnly`].
    pub fn open(path: impl AsRef<Path>) -> Result<Ledger> {
        Self::open_as(path.as_ref(), true)
    }

    /// Opens the ledger at `path` for reading only, as [`Ledger::open`] checks it: its
    /// [`status`](Ledger::status) lists the tenants whose processes died without taking them
    /// out (`dead`); every change (join, leave, limit, floor, reap, removing it) is refused
    /// with [`PoolError::ReadOnly`]. What a monitor that must never write uses.
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Ledger> {
        Self::open_as(path.as_ref(), false)
    }

    fn open_as(path: &Path, writable: bool) -> Result<Ledger> {
        let meta = match std::fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(PoolError::NotFound { path: path.into() })
            }
            Err(e) => return Err(os("stat", path)(e)),
        };
        if !meta.file_type().is_file() {
            return Err(PoolError::NotALedger {
                path: path.into(),
                why: format!("it is {}", describe(meta.file_type())),
            });
        }
        let opened = if writable {
            sys::open(path, None).map(|fd| (fd, None))
        } else {
            sys::open_read_only(path).map(|fd| (fd, Some(READ_ONLY_ASKED)))
        };
        let opened = match opened {
            Err(e) if writable && e.raw_os_error() == Some(libc::EROFS) => {
                sys::open_read_only(path).map(|fd| (fd, Some(READ_ONLY_FILESYSTEM)))
            }
            other => other,
        };
        let (fd, read_only) = match opened {
            Ok(opened) => opened,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM)) => {
                use std::os::unix::fs::MetadataExt;
                let why = access::check(
                    meta.uid(),
                    meta.gid(),
                    meta.mode(),
                    sys::euid(),
                    &sys::groups(),
                )
                .err()
                .unwrap_or_else(|| {
                    format!(
                        "the file's mode {:04o} does not let this user open it",
                        meta.mode() & 0o777
                    )
                });
                return Err(PoolError::PermissionDenied {
                    path: path.into(),
                    why,
                });
            }
            Err(e) => return Err(os("open", path)(e)),
        };
        Self::from_file(path, File::from(fd), read_only)
    }

    /// Checks an open file and maps it (read-only, saying why, when `read_only`).
    fn from_file(path: &Path, file: File, read_only: Option<&'static str>) -> Result<Ledger> {
        let not = |why: String| PoolError::NotALedger {
            path: path.into(),
            why,
        };
        let corrupt = |why: String| PoolError::Corrupt {
            path: path.into(),
            why,
        };
        let info = sys::fstat(file.as_fd()).map_err(os("fstat", path))?;
        if !info.is_regular() {
            return Err(not("it is not a regular file".into()));
        }
        access::check(info.uid, info.gid, info.mode, sys::euid(), &sys::groups()).map_err(
            |why| PoolError::PermissionDenied {
                path: path.into(),
                why,
            },
        )?;
        let header_len = HEADER_WORDS * 8;
        if info.len < header_len as u64 {
            return Err(not(format!(
                "{} bytes, shorter than a ledger's {header_len}-byte header",
                info.len
            )));
        }
        let mut raw = vec![0u8; header_len];
        file.read_exact_at(&mut raw, 0).map_err(os("read", path))?;
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        if word(h::MAGIC) != layout::MAGIC {
            return Err(not(
                "it does not start with the ledger's magic \"VMEMPOOL\"".into(),
            ));
        }
        if word(h::VERSION) != layout::VERSION {
            return Err(PoolError::UnsupportedVersion {
                path: path.into(),
                found: word(h::VERSION),
                supported: layout::VERSION,
            });
        }
        let seal = layout::seal((0..h::SEAL).map(word));
        if seal != word(h::SEAL) {
            return Err(corrupt(
                "the header's seal does not match its contents".into(),
            ));
        }
        let slots = word(h::SLOTS);
        if slots == 0 || slots > layout::MAX_SLOTS || word(h::SLOT_WORDS) != SLOT_WORDS as u64 {
            return Err(corrupt(format!(
                "{slots} slots of {} words",
                word(h::SLOT_WORDS)
            )));
        }
        if info.len != layout::file_len(slots) {
            return Err(corrupt(format!(
                "{} bytes long, a ledger of {slots} slots has {}",
                info.len,
                layout::file_len(slots)
            )));
        }
        let (total, default_limit) = (word(h::TOTAL), word(h::DEFAULT_LIMIT));
        if total == 0 || default_limit == 0 || default_limit > total {
            return Err(corrupt(format!(
                "total {total} bytes, default limit {default_limit}"
            )));
        }
        let map = Mapping::new(file.as_fd(), info.len as usize, read_only.is_none())
            .map_err(os("mmap", path))?;
        let mut ledger = Ledger::from_parts(path, map, file, slots as usize, total, default_limit);
        if read_only.is_some() {
            ledger.read_only = read_only;
            let _reader = ledger.reader()?;
            ledger.check_read_only()?;
        } else {
            let admin = ledger.admin()?;
            ledger.check(&admin)?;
        }
        Ok(ledger)
    }
}
