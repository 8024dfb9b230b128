//! One GPU's KV memory shared by several vmem processes ("tenants"): a ledger of per-tenant
//! limits and usage in one shared file, and [`PoolBackend`], a backend decorator that charges
//! it for every physical page, so that the tenants together never exceed the pool and each
//! stays within its limit, which an operator can change while they run.
//!
//! Each process maps its own physical pages, as without a pool; only the accounting is
//! shared. A tenant's liveness is a lock the kernel drops when its process dies, so the usage
//! of a tenant killed with SIGKILL is taken out of the ledger by the next process that
//! touches it (a join, a status, a limit change, or a charge the pool would refuse). See
//! `docs/multitenant.md` for the design and its measurements.
//!
//! ```
//! use std::sync::Arc;
//! use vmem::backend::{Backend, SimBackend};
//! use vmem_pool::{Ledger, Limit, PoolBackend, PoolConfig};
//!
//! let dir = std::env::temp_dir().join(format!("vmem-pool-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("pool");
//! // The operator: a pool of 8 MiB.
//! let ledger = Arc::new(Ledger::create(&path, &PoolConfig::new(8 << 20)?)?);
//! // A tenant process: joins with a limit of 4 MiB and maps pages as usual.
//! let tenant = Arc::new(Ledger::open(&path)?).join("llama", Some(Limit::Bytes(4 << 20)))?;
//! let backend = PoolBackend::new(Arc::new(SimBackend::new()), tenant);
//! let two_mib = 2 << 20;
//! let a = backend.create_page(two_mib)?;
//! let _b = backend.create_page(two_mib)?;
//! assert!(backend.create_page(two_mib).is_err(), "over its 4 MiB limit");
//! // The operator raises the limit: the tenant grows at once.
//! ledger.set_limit("llama", Limit::Percent(75))?;
//! let _c = backend.create_page(two_mib)?;
//! backend.release_page(a)?;
//! assert_eq!(ledger.status()?.used, 4 << 20);
//! # drop(backend); std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod access;
mod backend;
mod config;
mod error;
mod file;
mod floor;
pub mod layout;
mod ledger;
mod status;
mod sys;
mod tenant;

pub use backend::PoolBackend;
pub use config::{Floor, Limit, PoolConfig, DEFAULT_SLOTS, MIN_BYTES};
pub use error::{PoolError, Refusal, Result};
pub use ledger::{Ledger, ADMIN_WAIT};
pub use status::{FloorChange, LimitChange, PoolStatus, Reaped, TenantStatus};
pub use tenant::Tenant;
