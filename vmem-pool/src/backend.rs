//! [`PoolBackend`]: a vmem backend whose physical pages are charged to a pool tenant.

use crate::error::{PoolError, Refusal};
use crate::tenant::Tenant;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use vmem::backend::{Backend, Delegate, PageHandle};
use vmem::{Result, VmemError};

/// A [`Backend`] decorator that charges its tenant for each page before
/// [`Backend::create_page`] and credits it when the page is released. A page that the
/// tenant's limit or the pool does not allow is refused with [`VmemError::OutOfMemory`],
/// which the KV-cache manager already handles (it preempts), so a manager over this backend
/// needs no change. Every other operation forwards.
///
/// Give it the backend to own: the pages that backend releases on drop, after the decorator
/// is gone, are the tenant's to give back when it leaves, which it does as it drops.
#[derive(Debug)]
pub struct PoolBackend {
    inner: Arc<dyn Backend>,
    /// Page sizes of the live pages, to credit the right size on release.
    pages: Mutex<HashMap<PageHandle, u64>>,
    tenant: Tenant,
}

impl PoolBackend {
    /// `inner`'s pages, charged to `tenant`.
    pub fn new(inner: Arc<dyn Backend>, tenant: Tenant) -> Self {
        PoolBackend {
            inner,
            pages: Mutex::new(HashMap::new()),
            tenant,
        }
    }

    /// The tenant it charges.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// Pages it created and has not released.
    pub fn live_pages(&self) -> usize {
        self.pages.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

fn to_vmem(e: PoolError, page_size: u64) -> VmemError {
    match e {
        PoolError::Refused {
            why,
            usage,
            limit,
            pool_used,
            pool_total,
            ..
        } => {
            let (room, cap) = match why {
                Refusal::TenantLimit => (limit.saturating_sub(usage), limit),
                Refusal::PoolFull => (pool_total.saturating_sub(pool_used), pool_total),
                // The free room is other tenants' floors: none of it is this tenant's.
                Refusal::Floors => (0, pool_total),
            };
            VmemError::OutOfMemory {
                needed_pages: 1,
                available_pages: room / page_size.max(1),
                cap_bytes: cap,
            }
        }
        other => VmemError::BackendUnavailable {
            backend: "pool",
            why: other.to_string(),
        },
    }
}

impl Delegate for PoolBackend {
    fn inner(&self) -> &dyn Backend {
        &*self.inner
    }

    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.inner.check_page_size(page_size)?;
        self.tenant
            .charge(page_size)
            .map_err(|e| to_vmem(e, page_size))?;
        match self.inner.create_page(page_size) {
            Ok(page) => {
                self.pages
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(page, page_size);
                Ok(page)
            }
            Err(e) => {
                // Not created: the charge goes back (it was just made, so it cannot exceed).
                let _ = self.tenant.credit(page_size);
                Err(e)
            }
        }
    }

    fn release_page(&self, page: PageHandle) -> Result<()> {
        let mut pages = self.pages.lock().unwrap_or_else(|p| p.into_inner());
        self.inner.release_page(page)?;
        if let Some(size) = pages.remove(&page) {
            // The charge was made when the page was created, so it is there to give back.
            let _ = self.tenant.credit(size);
        }
        Ok(())
    }
}
