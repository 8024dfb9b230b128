//! A wrapper that makes chosen calls of an inner backend fail, for fault tests.

use super::{Backend, BackendKind, PageHandle};
use crate::error::{Result, VmemError};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

/// Which calls fail: the `n`-th call (1-based, counted from when the plan was set) of each
/// operation named. `None` never fails.
#[derive(Debug, Default, Clone, Copy)]
pub struct FaultPlan {
    /// Fail the n-th `create_page`.
    pub create: Option<u64>,
    /// Fail the n-th `map`.
    pub map: Option<u64>,
    /// Fail the n-th `unmap`.
    pub unmap: Option<u64>,
    /// Fail the n-th `reserve`.
    pub reserve: Option<u64>,
}

/// Injects the failures of a [`FaultPlan`] into an inner backend; all other calls pass through.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    plan: std::sync::Mutex<FaultPlan>,
    calls: [AtomicU64; 4],
}

impl FaultyBackend {
    /// Wraps `inner` with no faults planned.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FaultyBackend {
            inner,
            plan: std::sync::Mutex::new(FaultPlan::default()),
            calls: Default::default(),
        }
    }

    /// Replaces the plan and restarts the call counts.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock().unwrap_or_else(|e| e.into_inner()) = plan;
        for c in &self.calls {
            c.store(0, SeqCst);
        }
    }

    fn check(&self, which: usize, op: &'static str) -> Result<()> {
        let n = self.calls[which].fetch_add(1, SeqCst) + 1;
        let plan = *self.plan.lock().unwrap_or_else(|e| e.into_inner());
        let target = [plan.create, plan.map, plan.unmap, plan.reserve][which];
        if target == Some(n) {
            return Err(VmemError::InjectedFault(op));
        }
        Ok(())
    }
}

impl Backend for FaultyBackend {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn page_sizes(&self) -> Vec<u64> {
        self.inner.page_sizes()
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        self.check(3, "reserve")?;
        self.inner.reserve(size)
    }
    fn free_range(&self, addr: u64) -> Result<()> {
        self.inner.free_range(addr)
    }
    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.check(0, "create_page")?;
        self.inner.create_page(page_size)
    }
    fn release_page(&self, page: PageHandle) -> Result<()> {
        self.inner.release_page(page)
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.check(1, "map")?;
        self.inner.map(addr, pages, page_size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.check(2, "unmap")?;
        self.inner.unmap(addr, size)
    }
}
