//! The ledger file's format: 64-bit words, a sealed header, then one fixed-size slot per
//! tenant. Every word is read and written atomically, by any process that maps the file.
//!
//! ```text
//! header (HEADER_WORDS words)          slot i (SLOT_WORDS words, at HEADER_WORDS + i * SLOT_WORDS)
//!  0 magic "VMEMPOOL"                   0 state (0 free, 1 live)
//!  1 version                            1 pid of the tenant process
//!  2 slot count                         2 limit, bytes
//!  3 slot words                         3 usage, bytes (the tenant's own counter)
//!  4 pool total, bytes                  4 limit revision (bumped by every change)
//!  5 default tenant limit, bytes        5-8 name, NUL-padded UTF-8
//!  6 created at, Unix seconds           9 peak usage, bytes
//!  7 seal of words 0-6                  10 joined at, Unix seconds
//!  8 slots in use (not sealed)
//!  9 slot being written + 1 (not sealed)
//!                                       11 seal of words 0-2, 4-8, 10 and 12
//!                                       12 floor, bytes (kept for it while idle)
//! ```
//!
//! Liveness is not in the file: a live tenant holds a write lock on its slot's first byte
//! (an `F_OFD_SETLK` lock on one byte), which the kernel drops when the tenant's process dies. The
//! header's first byte is the lock of the operations that change who is in the pool (join,
//! leave, limit, reap).

use std::sync::atomic::{AtomicU64, Ordering};

/// `b"VMEMPOOL"` as a little-endian word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VMEMPOOL");
/// The format this crate writes and reads (2: the slot's floor word; version 1 had none).
pub const VERSION: u64 = 2;
/// Words in the header.
pub const HEADER_WORDS: usize = 64;
/// Words in one slot.
pub const SLOT_WORDS: usize = 16;
/// Most tenant slots a ledger may have.
pub const MAX_SLOTS: u64 = 1024;
/// Longest tenant name, in bytes.
pub const MAX_NAME: usize = 31;

/// Header word indices.
pub mod h {
    /// Magic.
    pub const MAGIC: usize = 0;
    /// Format version.
    pub const VERSION: usize = 1;
    /// Slot count.
    pub const SLOTS: usize = 2;
    /// Words per slot.
    pub const SLOT_WORDS: usize = 3;
    /// Pool total, bytes.
    pub const TOTAL: usize = 4;
    /// Default tenant limit, bytes.
    pub const DEFAULT_LIMIT: usize = 5;
    /// Creation time.
    pub const CREATED: usize = 6;
    /// Seal of the words before it.
    pub const SEAL: usize = 7;
    /// Slots in use (not sealed: raised by joins, under the header's lock): every live slot
    /// is below it, so a charge sums only those.
    pub const IN_USE: usize = 8;
    /// The slot (plus one) that the holder of the header's lock is writing, 0 when none (not
    /// sealed): a process killed between a slot's first store and its seal leaves it set, and
    /// the next holder repairs that slot instead of finding its seal broken.
    pub const WRITING: usize = 9;
}

/// Slot word offsets.
pub mod s {
    /// 0 free, 1 live.
    pub const STATE: usize = 0;
    /// Tenant pid.
    pub const PID: usize = 1;
    /// Limit, bytes.
    pub const LIMIT: usize = 2;
    /// Usage, bytes.
    pub const USAGE: usize = 3;
    /// Limit revision.
    pub const REVISION: usize = 4;
    /// First of the four name words.
    pub const NAME: usize = 5;
    /// Peak usage, bytes.
    pub const PEAK: usize = 9;
    /// Join time.
    pub const JOINED: usize = 10;
    /// Seal.
    pub const SEAL: usize = 11;
    /// Floor, bytes: room the pool keeps for the tenant while it holds less (0: none).
    pub const FLOOR: usize = 12;
    /// The words the seal covers.
    pub const SEALED: [usize; 10] = [
        STATE,
        PID,
        LIMIT,
        REVISION,
        NAME,
        NAME + 1,
        NAME + 2,
        NAME + 3,
        JOINED,
        FLOOR,
    ];
}

/// Slot states.
pub const FREE: u64 = 0;
/// A slot that a tenant joined (alive while its lock is held).
pub const LIVE: u64 = 1;

/// The file length of a ledger of `slots` slots.
pub fn file_len(slots: u64) -> u64 {
    (HEADER_WORDS as u64 + slots * SLOT_WORDS as u64) * 8
}

/// The byte whose lock says slot `i` is alive.
pub fn slot_lock_byte(i: usize) -> u64 {
    ((HEADER_WORDS + i * SLOT_WORDS) * 8) as u64
}

/// The byte whose lock serializes joins, leaves, limit changes and reaping.
pub const ADMIN_LOCK_BYTE: u64 = 0;

/// FNV-1a over words, salted so that an all-zero region does not seal itself.
pub fn seal(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut x: u64 = 0xcbf2_9ce4_8422_2325 ^ MAGIC;
    for w in words {
        for b in w.to_le_bytes() {
            x ^= u64::from(b);
            x = x.wrapping_mul(0x0100_0000_01b3);
        }
    }
    x
}

/// The header's seal as stored words `0..SEAL` give it.
pub fn header_seal(w: &[AtomicU64]) -> u64 {
    seal((0..h::SEAL).map(|i| w[i].load(Ordering::Acquire)))
}

/// A slot's seal as its stored words give it.
pub fn slot_seal(slot: &[AtomicU64]) -> u64 {
    seal(s::SEALED.iter().map(|&i| slot[i].load(Ordering::Acquire)))
}

/// A tenant name packed into the four name words.
pub fn pack_name(name: &str) -> [u64; 4] {
    let mut bytes = [0u8; 32];
    bytes[..name.len()].copy_from_slice(name.as_bytes());
    let mut out = [0u64; 4];
    for (i, w) in out.iter_mut().enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        *w = u64::from_le_bytes(b);
    }
    out
}

/// The name in four name words, or `None` if they do not hold a valid one.
pub fn unpack_name(words: [u64; 4]) -> Option<String> {
    let mut bytes = Vec::with_capacity(32);
    for w in words {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    if bytes[end..].iter().any(|&b| b != 0) {
        return None;
    }
    let name = String::from_utf8(bytes[..end].to_vec()).ok()?;
    check_name(&name).ok()?;
    Some(name)
}

/// Checks a tenant name: 1 to [`MAX_NAME`] bytes of letters, digits, `.`, `_` and `-`.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!(
            "tenant name {} must be 1 to {MAX_NAME} bytes long",
            vmem::units::quoted(name)
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    {
        return Err(format!(
            "tenant name {} may hold only letters, digits, '.', '_' and '-'",
            vmem::units::quoted(name)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_names_are_refused() {
        for n in ["a", "llama-8b", "m.v2_x", &"x".repeat(MAX_NAME)] {
            assert_eq!(unpack_name(pack_name(n)).as_deref(), Some(n));
        }
        for n in ["", "a b", "ü", "a/b", &"x".repeat(MAX_NAME + 1)] {
            assert!(check_name(n).is_err(), "{n:?}");
        }
        // Bytes after the terminating NUL: not a name this crate wrote.
        let mut w = pack_name("ab");
        w[3] = 1;
        assert_eq!(unpack_name(w), None);
    }

    #[test]
    fn a_changed_word_breaks_the_seal() {
        let a = seal([1, 2, 3]);
        assert_ne!(a, seal([1, 2, 4]));
        assert_ne!(a, seal([1, 3, 2]));
        assert_ne!(seal([0; 7]), 0);
    }
}
