//! What a pool is made with, and tenant limits as operators write them: validated values.

use crate::error::{PoolError, Result};
use crate::layout::MAX_SLOTS;
use std::str::FromStr;
use vmem::units::{format_bytes, parse_bytes, quoted};

/// The least a pool's total or a tenant's limit may be: one page of vmem's smallest size
/// (64 KiB). Less could never hold a page, as zero could not.
pub const MIN_BYTES: u64 = vmem::backend::KIB64;

/// A tenant's limit: bytes, or a share of the pool's total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// At most this many bytes (at least 1).
    Bytes(u64),
    /// At most this percentage of the pool's total (1 to 100).
    Percent(u32),
}

impl Limit {
    /// The limit in bytes in a pool of `total` bytes; a limit of less than one page
    /// ([`MIN_BYTES`]), or one above the pool's total, is refused.
    pub fn resolve(self, total: u64) -> Result<u64> {
        let bytes = self.amount().bytes_in(total);
        if bytes < MIN_BYTES {
            return Err(PoolError::InvalidSetting(format!(
                "a limit of {self} is {bytes} bytes, less than one page ({}): a tenant needs \
                 room for at least one (to stop one, stop its process)",
                format_bytes(MIN_BYTES)
            )));
        }
        within_total("limit", self, bytes, total)
    }

    fn amount(self) -> Amount {
        match self {
            Limit::Bytes(b) => Amount::Bytes(b),
            Limit::Percent(p) => Amount::Percent(p),
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.amount().fmt(f)
    }
}

impl FromStr for Limit {
    type Err = PoolError;

    /// `4G`, `512M`, `1073741824` (bytes) or `25%` (of the pool).
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| PoolError::InvalidSetting(format!("limit {}: {why}", quoted(s)));
        match parse_amount("limit", s)? {
            Amount::Percent(0) => Err(bad("a share is 1% to 100%")),
            Amount::Percent(p) => Ok(Limit::Percent(p)),
            Amount::Bytes(0) => Err(bad("a limit of 0 bytes lets the tenant hold nothing")),
            Amount::Bytes(b) if b < MIN_BYTES => Err(bad(&format!(
                "less than one page ({}): the tenant could hold nothing",
                format_bytes(MIN_BYTES)
            ))),
            Amount::Bytes(b) => Ok(Limit::Bytes(b)),
        }
    }
}

/// A size or a share as operators write them, zero allowed (the caller decides): what a
/// [`Limit`] and a [`Floor`] are made of.
#[derive(Clone, Copy)]
enum Amount {
    Bytes(u64),
    Percent(u32),
}

impl Amount {
    /// Bytes in a pool of `total` bytes (a share rounded down).
    fn bytes_in(self, total: u64) -> u64 {
        match self {
            Amount::Bytes(b) => b,
            Amount::Percent(p) => ((u128::from(total) * u128::from(p)) / 100) as u64,
        }
    }
}

impl std::fmt::Display for Amount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Amount::Bytes(b) => write!(f, "{}", format_bytes(*b)),
            Amount::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// `bytes` of a `what` written as `shown`, refused when above the pool's `total`.
fn within_total(what: &str, shown: impl std::fmt::Display, bytes: u64, total: u64) -> Result<u64> {
    if bytes > total {
        return Err(PoolError::InvalidSetting(format!(
            "{what} {shown} ({bytes} bytes) exceeds the pool's total {} ({total} bytes)",
            format_bytes(total)
        )));
    }
    Ok(bytes)
}

fn parse_amount(what: &str, s: &str) -> Result<Amount> {
    let t = s.trim();
    let bad = |why: String| PoolError::InvalidSetting(format!("{what} {}: {why}", quoted(s)));
    if let Some(p) = t.strip_suffix('%') {
        let p: u32 = p
            .trim()
            .parse()
            .map_err(|_| bad("a share is a whole percentage, e.g. 25%".into()))?;
        if p > 100 {
            // A floor may be 0% (none); a limit's 0% is refused by its caller.
            let least = if what == "floor" { 0 } else { 1 };
            return Err(bad(format!("a share is {least}% to 100%")));
        }
        return Ok(Amount::Percent(p));
    }
    if t.starts_with('-') {
        return Err(bad(format!("a {what} cannot be negative")));
    }
    Ok(Amount::Bytes(
        parse_bytes(t).map_err(|e| bad(e.to_string()))?,
    ))
}

/// A tenant's guaranteed floor: room the pool keeps for it while it holds less, even while it
/// is idle (other tenants' pages that would eat into it are refused). Bytes or a share of the
/// pool's total; zero is no floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// This many bytes (0: none).
    Bytes(u64),
    /// This percentage of the pool's total (0 to 100).
    Percent(u32),
}

impl Floor {
    /// No floor.
    pub const NONE: Floor = Floor::Bytes(0);

    /// The floor in bytes in a pool of `total` bytes; one above the total is refused.
    pub fn resolve(self, total: u64) -> Result<u64> {
        within_total("floor", self, self.amount().bytes_in(total), total)
    }

    fn amount(self) -> Amount {
        match self {
            Floor::Bytes(b) => Amount::Bytes(b),
            Floor::Percent(p) => Amount::Percent(p),
        }
    }
}

impl std::fmt::Display for Floor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.amount().fmt(f)
    }
}

impl FromStr for Floor {
    type Err = PoolError;

    /// `4G`, `512M`, bytes, `25%` (of the pool), or `0` (no floor).
    fn from_str(s: &str) -> Result<Self> {
        Ok(match parse_amount("floor", s)? {
            Amount::Bytes(b) => Floor::Bytes(b),
            Amount::Percent(p) => Floor::Percent(p),
        })
    }
}

/// Default tenant slots of a new ledger.
pub const DEFAULT_SLOTS: u64 = 64;

/// How a pool is created: its total, tenant slots, the limit of tenants that join without
/// one, and the group granted access. Made by [`PoolConfig::new`] and its setters, each of
/// which validates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    pub(crate) total: u64,
    pub(crate) slots: u64,
    pub(crate) default_limit: u64,
    pub(crate) group: Option<u32>,
}

impl PoolConfig {
    /// A pool of `total` bytes (at least one page, [`MIN_BYTES`]), 64 slots, tenants
    /// limited to the whole pool by default, owner-only.
    pub fn new(total: u64) -> Result<Self> {
        if total == 0 {
            return Err(PoolError::InvalidSetting(
                "a pool of 0 bytes holds nothing".into(),
            ));
        }
        if total < MIN_BYTES {
            return Err(PoolError::InvalidSetting(format!(
                "a pool of {total} bytes holds no page (the smallest is {})",
                format_bytes(MIN_BYTES)
            )));
        }
        Ok(PoolConfig {
            total,
            slots: DEFAULT_SLOTS,
            default_limit: total,
            group: None,
        })
    }

    /// A pool of the device's free memory `free` less `reserve` (what the GPU keeps for
    /// activations, the CUDA context and other processes).
    pub fn free_less_reserve(free: u64, reserve: u64) -> Result<Self> {
        match free.checked_sub(reserve) {
            Some(t) if t > 0 => Self::new(t),
            _ => Err(PoolError::InvalidSetting(format!(
                "the reserve {} is not below the device's free memory {}",
                format_bytes(reserve),
                format_bytes(free)
            ))),
        }
    }

    /// Tenant slots: how many tenants may be in the pool at once (1 to 1024).
    pub fn slots(mut self, slots: u64) -> Result<Self> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(PoolError::InvalidSetting(format!(
                "{slots} tenant slots: a pool has 1 to {MAX_SLOTS}"
            )));
        }
        self.slots = slots;
        Ok(self)
    }

    /// The limit of a tenant that joins without one.
    pub fn default_limit(mut self, limit: Limit) -> Result<Self> {
        self.default_limit = limit.resolve(self.total)?;
        Ok(self)
    }

    /// Grants group `gid` access (file mode 0660 instead of 0600): its members may join and
    /// change limits.
    pub fn group(mut self, gid: u32) -> Self {
        self.group = Some(gid);
        self
    }

    /// [`PoolConfig::group`] by the group's name, or its number where no group has that
    /// name.
    pub fn group_named(self, name: &str) -> Result<Self> {
        match crate::sys::group_id(name) {
            Ok(Some(gid)) => Ok(self.group(gid)),
            // A number where no group has that name: the group of that id.
            Ok(None) => match name.parse::<u32>() {
                Ok(gid) if name.bytes().all(|b| b.is_ascii_digit()) && gid != u32::MAX => {
                    Ok(self.group(gid))
                }
                _ => Err(PoolError::InvalidSetting(format!(
                    "no group named {}",
                    quoted(name)
                ))),
            },
            Err(e) => Err(PoolError::InvalidSetting(format!(
                "cannot look up group {}: {e}",
                quoted(name)
            ))),
        }
    }

    /// The pool's total, bytes.
    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn limits_parse_and_bad_ones_are_refused() {
        assert_eq!("4G".parse::<Limit>().unwrap(), Limit::Bytes(4 << 30));
        assert_eq!(" 25% ".parse::<Limit>().unwrap(), Limit::Percent(25));
        for bad in [
            "0",
            "0%",
            "-1G",
            "-5%",
            "101%",
            "1.5%",
            "abc",
            "",
            "99999999999T",
            "%",
        ] {
            assert!(bad.parse::<Limit>().is_err(), "{bad:?}");
        }
        assert_eq!(Limit::Percent(50).resolve(1 << 20).unwrap(), 512 << 10);
        assert!(Limit::Percent(1).resolve(50).is_err(), "rounds to 0 bytes");
        assert!(Limit::Bytes(MIB + 1).resolve(MIB).is_err());
    }

    #[test]
    fn floors_parse_zero_is_none_and_bad_ones_are_refused() {
        assert_eq!("0".parse::<Floor>().unwrap(), Floor::NONE);
        assert_eq!("0%".parse::<Floor>().unwrap(), Floor::Percent(0));
        assert_eq!("1G".parse::<Floor>().unwrap(), Floor::Bytes(1 << 30));
        assert_eq!(" 20% ".parse::<Floor>().unwrap(), Floor::Percent(20));
        for bad in [
            "-1",
            "-1G",
            "-5%",
            "101%",
            "1.5%",
            "abc",
            "",
            "%",
            "99999999999T",
        ] {
            assert!(bad.parse::<Floor>().is_err(), "{bad:?}");
        }
        assert_eq!(Floor::Percent(25).resolve(1000).unwrap(), 250);
        assert_eq!(Floor::NONE.resolve(1000).unwrap(), 0);
        assert!(Floor::Bytes(1001).resolve(1000).is_err());
    }

    #[test]
    fn configs_validate() {
        assert!(PoolConfig::new(0).is_err());
        let one_page = PoolConfig::new(MIN_BYTES).unwrap();
        assert!(one_page.clone().slots(0).is_err());
        assert!(one_page.clone().slots(MAX_SLOTS + 1).is_err());
        assert!(PoolConfig::free_less_reserve(10, 10).is_err());
        assert_eq!(
            PoolConfig::free_less_reserve(MIN_BYTES + 4, 4)
                .unwrap()
                .total(),
            MIN_BYTES
        );
        assert!(one_page.group_named("no-such-group-xyz").is_err());
    }
}
