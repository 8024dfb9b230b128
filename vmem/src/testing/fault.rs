//! A wrapper that makes chosen calls of an inner backend fail, for fault tests.

use crate::backend::{Backend, Delegate, Fence, PageHandle};
use crate::error::{Result, VmemError};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

/// The backend operations a [`FaultPlan`] can make fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Backend::reserve`](crate::backend::Backend::reserve).
    Reserve,
    /// [`Backend::create_page`].
    Create,
    /// [`Backend::map`] and [`Backend::map_zero`].
    Map,
    /// [`Backend::unmap`].
    Unmap,
}

impl Op {
    /// Every operation, in a fixed order.
    pub const ALL: [Op; 4] = [Op::Reserve, Op::Create, Op::Map, Op::Unmap];

    /// The operation's name, as [`VmemError::InjectedFault`] reports it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Reserve => "reserve",
            Op::Create => "create_page",
            Op::Map => "map",
            Op::Unmap => "unmap",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Which calls fail: the `n`-th call (1-based, counted from when the plan was set) of each
/// operation named. `None` never fails.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    /// Fail the n-th `create_page`.
    pub create: Option<u64>,
    /// Fail the n-th `map` or `map_zero`.
    pub map: Option<u64>,
    /// Fail the n-th `unmap`.
    pub unmap: Option<u64>,
    /// Fail the n-th `reserve`.
    pub reserve: Option<u64>,
}

impl FaultPlan {
    /// Which call of `op` fails, if any.
    pub fn target(&self, op: Op) -> Option<u64> {
        match op {
            Op::Reserve => self.reserve,
            Op::Create => self.create,
            Op::Map => self.map,
            Op::Unmap => self.unmap,
        }
    }
}

/// Injects the failures of a [`FaultPlan`] into an inner backend; all other calls pass through.
/// A failed call reaches nothing of the inner backend.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    plan: Mutex<FaultPlan>,
    calls: [AtomicU64; Op::ALL.len()],
}

impl FaultyBackend {
    /// Wraps `inner` with no faults planned.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FaultyBackend {
            inner,
            plan: Mutex::new(FaultPlan::default()),
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

    /// Calls of `op` since the plan was set.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op.index()].load(SeqCst)
    }

    fn check(&self, op: Op) -> Result<()> {
        let n = self.calls[op.index()].fetch_add(1, SeqCst) + 1;
        let plan = *self.plan.lock().unwrap_or_else(|e| e.into_inner());
        if plan.target(op) == Some(n) {
            return Err(VmemError::InjectedFault(op.name()));
        }
        Ok(())
    }
}

impl Delegate for FaultyBackend {
    fn inner(&self) -> &dyn Backend {
        &*self.inner
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        self.check(Op::Reserve)?;
        self.inner.reserve(size)
    }
    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.check(Op::Create)?;
        self.inner.create_page(page_size)
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.check(Op::Map)?;
        self.inner.map(addr, pages, page_size)
    }
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.check(Op::Map)?;
        self.inner.map_shared(addr, pages, page_size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.check(Op::Unmap)?;
        self.inner.unmap(addr, size)
    }
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()> {
        self.check(Op::Unmap)?;
        self.inner.unmap_fenced(fence, addr, size)
    }
    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()> {
        self.check(Op::Map)?;
        self.inner.map_zero(addr, size, page_size)
    }
}
