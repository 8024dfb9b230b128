//! The shared KV pool (`vmem-pool`) from Python: `Pool` (create, open, status, limits,
//! reaping: what `vmem pool` does), and joining one as a tenant from a `KVCache` ([`join`]).
//! `vmem/pool.py` turns the dicts handed out here into typed objects.

use crate::dict::fields_dict;
use crate::PoolError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::Arc;
use vmem::backend::{open_backend, Backend, BackendChoice};
use vmem::units::{parse_bytes, quoted};
use vmem_pool::{
    Floor, Ledger, Limit, PoolBackend, PoolConfig, PoolError as CoreError, PoolStatus,
};

/// A pool error as `vmem.PoolError`, with the message `vmem pool` prints.
pub(crate) fn pool_err(e: CoreError) -> PyErr {
    PoolError::new_err(e.to_string())
}

fn setting(why: String) -> PyErr {
    pool_err(CoreError::InvalidSetting(why))
}

/// A limit as operators write it: `"12G"`, `"25%"` or a number of bytes (as a string).
fn limit(s: &str) -> PyResult<Limit> {
    s.parse().map_err(pool_err)
}

/// A floor as operators write it: `"12G"`, `"25%"`, bytes (as a string), `"0"` for none.
fn floor(s: &str) -> PyResult<Floor> {
    s.parse().map_err(pool_err)
}

fn size(flag: &str, s: &str) -> PyResult<u64> {
    if s.trim_start().starts_with('-') {
        return Err(setting(format!(
            "{flag} {}: a size cannot be negative",
            quoted(s)
        )));
    }
    parse_bytes(s).map_err(|e| setting(format!("{flag}: {e}")))
}

/// An open pool ledger.
#[pyclass(module = "vmem._vmem", frozen)]
pub(crate) struct Pool {
    ledger: Arc<Ledger>,
}

fn status_dict<'py>(py: Python<'py>, st: &PoolStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = fields_dict!(py, st; total, default_limit, slots, used);
    d.set_item("path", st.path.display().to_string())?;
    let tenants = st
        .tenants
        .iter()
        .map(|t| {
            let e = fields_dict!(py, t; slot, pid, limit, floor, usage, peak, revision, joined);
            e.set_item("name", &t.name)?;
            e.set_item("over_limit", t.over_limit())?;
            Ok(e)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("tenants", tenants)?;
    d.set_item("reaped", reaped_dicts(py, &st.reaped)?)?;
    d.set_item("dead", reaped_dicts(py, &st.dead)?)?;
    d.set_item("read_only", st.read_only)?;
    Ok(d)
}

fn reaped_dicts<'py>(
    py: Python<'py>,
    reaped: &[vmem_pool::Reaped],
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    reaped
        .iter()
        .map(|r| {
            let d = fields_dict!(py, r; pid, usage);
            d.set_item("name", &r.name)?;
            Ok(d)
        })
        .collect()
}

#[pymethods]
impl Pool {
    /// Creates a pool ledger at `path` (never replacing anything): `size` bytes, or the
    /// device's free memory less `reserve`; checked like `vmem pool create`.
    #[staticmethod]
    #[pyo3(signature = (path, *, size, reserve, backend, device, slots, default_limit, group))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        path: PathBuf,
        size: Option<&str>,
        reserve: &str,
        backend: &str,
        device: usize,
        slots: u64,
        default_limit: Option<&str>,
        group: Option<&str>,
    ) -> PyResult<Pool> {
        // Checked even with a size, which does not read it: a misspelt backend is refused.
        let choice: BackendChoice = backend
            .parse()
            .map_err(|e: vmem::VmemError| setting(format!("backend: {e}")))?;
        let config = match size {
            Some(s) => PoolConfig::new(self::size("size", s)?),
            None => {
                let reserve = self::size("reserve", reserve)?;
                let sel = py
                    .detach(|| open_backend(choice, device))
                    .map_err(|e| setting(format!("backend {backend}: {e}; or give size")))?;
                let free = sel.backend.free_memory().ok_or_else(|| {
                    setting(format!(
                        "the {} backend cannot tell its free memory: give size",
                        sel.backend.name()
                    ))
                })?;
                PoolConfig::free_less_reserve(free, reserve)
            }
        };
        let mut config = config.and_then(|c| c.slots(slots)).map_err(pool_err)?;
        if let Some(l) = default_limit {
            config = config.default_limit(limit(l)?).map_err(pool_err)?;
        }
        if let Some(g) = group {
            config = config.group_named(g).map_err(pool_err)?;
        }
        let ledger = Ledger::create(&path, &config).map_err(pool_err)?;
        Ok(Pool {
            ledger: Arc::new(ledger),
        })
    }

    /// Opens the pool ledger at `path` (with `read_only`, for reading only).
    #[staticmethod]
    #[pyo3(signature = (path, read_only = false))]
    fn open(path: PathBuf, read_only: bool) -> PyResult<Pool> {
        let ledger = if read_only {
            Ledger::open_read_only(&path)
        } else {
            Ledger::open(&path)
        };
        Ok(Pool {
            ledger: Arc::new(ledger.map_err(pool_err)?),
        })
    }

    /// The ledger's path, the pool's total, tenant slots and default limit.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("path", self.ledger.path().display().to_string())?;
        d.set_item("total", self.ledger.total())?;
        d.set_item("slots", self.ledger.slots())?;
        d.set_item("default_limit", self.ledger.default_limit())?;
        Ok(d)
    }

    /// The pool now (dead tenants reaped first and listed; on a ledger open read-only, left in
    /// and listed under `dead`).
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = py.detach(|| self.ledger.status()).map_err(pool_err)?;
        status_dict(py, &st)
    }

    /// Sets live tenant `tenant`'s limit (`"12G"`, `"25%"`, bytes as a string).
    fn set_limit<'py>(
        &self,
        py: Python<'py>,
        tenant: &str,
        limit: &str,
    ) -> PyResult<Bound<'py, PyDict>> {
        let l = self::limit(limit)?;
        let ch = py
            .detach(|| self.ledger.set_limit(tenant, l))
            .map_err(pool_err)?;
        Ok(fields_dict!(py, ch; name, old, new, usage, revision))
    }

    /// Sets live tenant `tenant`'s floor (`"12G"`, `"25%"`, bytes as a string, `"0"`: none).
    fn set_floor<'py>(
        &self,
        py: Python<'py>,
        tenant: &str,
        floor: &str,
    ) -> PyResult<Bound<'py, PyDict>> {
        let f = self::floor(floor)?;
        let ch = py
            .detach(|| self.ledger.set_floor(tenant, f))
            .map_err(pool_err)?;
        Ok(fields_dict!(py, ch; name, old, new, usage, floors))
    }

    /// Takes dead tenants out of the pool; returns them.
    fn reap<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let r = py.detach(|| self.ledger.reap()).map_err(pool_err)?;
        reaped_dicts(py, &r)
    }
}

/// How a cache joins a pool, as `vmem.pool.Join.args()` hands it over:
/// `(tenant, limit, floor, ledger)`.
pub(crate) type JoinArgs = (String, Option<String>, Option<String>, String);

/// `backend` with its pages charged to a new tenant of the pool (`limit`: the ledger's
/// default when `None`; `floor`: none when `None`).
pub(crate) fn join(backend: Arc<dyn Backend>, args: &JoinArgs) -> PyResult<Arc<PoolBackend>> {
    let (name, limit, floor, ledger) = args;
    let l = limit.as_deref().map(self::limit).transpose()?;
    let f = floor.as_deref().map(self::floor).transpose()?;
    let ledger = Arc::new(Ledger::open(ledger).map_err(pool_err)?);
    let tenant = ledger
        .join_with_floor(name, l, f.unwrap_or(Floor::NONE))
        .map_err(pool_err)?;
    Ok(Arc::new(PoolBackend::new(backend, tenant)))
}

/// What a joined cache's tenant reads of its own slot: atomic loads, no lock.
pub(crate) fn tenant_dict<'py>(py: Python<'py>, b: &PoolBackend) -> PyResult<Bound<'py, PyDict>> {
    let t = b.tenant();
    let d = PyDict::new(py);
    d.set_item("name", t.name())?;
    d.set_item("pid", std::process::id())?;
    d.set_item("ledger", t.ledger().path().display().to_string())?;
    d.set_item("limit", t.limit())?;
    d.set_item("floor", t.floor())?;
    d.set_item("usage", t.usage())?;
    d.set_item("revision", t.limit_revision())?;
    d.set_item("over_limit", t.over_limit().unwrap_or(0))?;
    d.set_item("pool_used", t.ledger().used())?;
    d.set_item("pool_total", t.ledger().total())?;
    d.set_item("pool_room", t.pool_room())?;
    d.set_item("pool_tenants", t.ledger().tenants())?;
    Ok(d)
}
