//! Lockstep (tensor parallelism): managers fed the same calls end every call with equal
//! decision digests — in one process, with the background thread's timing made to differ
//! between them, and across processes — and a divergent call sequence is caught, naming the
//! step.

use std::process::Command;
use std::sync::Arc;
use vmem::backend::{Backend, HostBackend, SimBackend, KIB64};
use vmem::{DecisionDigest, KvCacheManager, VmemError};
use vmem_tests::small_kv;

/// A small seeded generator (xorshift64*), so both ranks draw the same sequence.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Backendkind {
    Sim,
    Host,
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    backend: Backendkind,
    overlap: bool,
    deferred: bool,
}

const BATCH: usize = 8;

fn manager(s: Setup) -> KvCacheManager {
    let b: Arc<dyn Backend> = match s.backend {
        Backendkind::Sim => Arc::new(SimBackend::new()),
        Backendkind::Host => Arc::new(HostBackend::new().unwrap()),
    };
    // 4 buffers of 256 B a token: 256 tokens a 64 KB page; 120 pages make steps run out of
    // memory now and then, so reclamation and out-of-memory outcomes are exercised.
    let cfg = small_kv(2, BATCH, 4096, KIB64)
        .memory_cap(120 * KIB64)
        .overlap(s.overlap)
        .deferred_reclaim(s.deferred)
        .build();
    KvCacheManager::init(b, cfg).unwrap()
}

/// An engine's calls, drawn from `seed`: admit (prefill), finish, decode steps; a step out of
/// memory preempts the longest request. Decisions index requests by admission order, never
/// by id, so two ranks make the same calls even if their managers handed out different ids.
/// `settle` waits for the background thread after every step (one rank's timing);
/// `diverge_at` adds a token to one request at that call (a rank out of lockstep). Returns
/// the digest after every call.
fn run(
    kv: &KvCacheManager,
    seed: u64,
    calls: usize,
    settle: bool,
    diverge_at: Option<usize>,
) -> Vec<DecisionDigest> {
    let mut rng = Rng::new(seed);
    let mut active: Vec<(usize, u64)> = Vec::new();
    let mut out = Vec::with_capacity(calls);
    let mut ooms = 0;
    for call in 0..calls {
        let roll = rng.below(100);
        if roll < 15 && active.len() < BATCH {
            let id = kv.alloc_reqid().unwrap();
            active.push((id, 1 + rng.below(1500)));
        } else if roll < 25 && !active.is_empty() {
            let i = rng.below(active.len() as u64) as usize;
            kv.free_reqid(active.remove(i).0).unwrap();
        } else {
            let mut lens = vec![0u64; BATCH];
            for (id, len) in &mut active {
                *len = (*len + 1 + rng.below(40)).min(4096);
                lens[*id] = *len;
            }
            if diverge_at == Some(call) {
                if let Some(&(id, _)) = active.first() {
                    lens[id] = (lens[id] + 300).min(4096);
                }
            }
            match kv.step(&lens) {
                Ok(_) => {}
                Err(VmemError::OutOfMemory { .. }) => {
                    ooms += 1;
                    let i = (0..active.len()).max_by_key(|&i| active[i].1).unwrap();
                    kv.free_reqid(active.remove(i).0).unwrap();
                }
                Err(e) => panic!("step {call}: {e}"),
            }
            if settle {
                kv.wait_idle();
            }
        }
        out.push(kv.decision_digest());
    }
    assert!(
        ooms > 0,
        "the workload must run out of memory at least once"
    );
    out
}

/// The first call after which two ranks' digests differ.
fn first_mismatch(a: &[DecisionDigest], b: &[DecisionDigest]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    (0..a.len()).find(|&i| a[i] != b[i])
}

/// Every lockstep-safe setup (docs/architecture.md, "Lockstep"): the background thread off,
/// or on without deferred reclamation.
fn setups() -> Vec<Setup> {
    let mut v = Vec::new();
    for backend in [Backendkind::Sim, Backendkind::Host] {
        for (overlap, deferred) in [(false, true), (false, false), (true, false)] {
            v.push(Setup {
                backend,
                overlap,
                deferred,
            });
        }
    }
    v
}

#[test]
fn same_calls_give_equal_digests_at_every_call() {
    for s in setups() {
        for seed in [1, 2, 3] {
            let (a, b) = (manager(s), manager(s));
            // One rank lets the background thread finish after every step, the other never
            // waits: what it maps early must not show.
            let da = run(&a, seed, 400, true, None);
            let db = run(&b, seed, 400, false, None);
            assert_eq!(first_mismatch(&da, &db), None, "{s:?} seed {seed}");
            assert!(da.last().unwrap().check(&[da[399], db[399]]).is_ok());
            // Different seeds make different decisions: the digest is not a constant.
            let dc = run(&manager(s), seed + 100, 400, false, None);
            assert_ne!(da.last(), dc.last(), "{s:?} seed {seed}");
        }
    }
}

#[test]
fn a_divergent_call_is_caught_naming_the_step() {
    for s in setups() {
        let (a, b) = (manager(s), manager(s));
        let da = run(&a, 7, 300, false, None);
        let db = run(&b, 7, 300, false, Some(150));
        let at = first_mismatch(&da, &db).expect("the divergence must show");
        assert_eq!(at, 150, "{s:?}: caught at the call that diverged");
        let all = [da[299], db[299]];
        match da[299].check(&all) {
            Err(VmemError::LockstepDivergence {
                step, rank, theirs, ..
            }) => {
                assert_eq!(step, da[299].steps);
                assert_eq!(rank, 1);
                assert_eq!(theirs, db[299]);
            }
            other => panic!("{s:?}: expected a lockstep divergence, got {other:?}"),
        }
        // Compared at the divergent call itself, the error names that step.
        let err = da[150].check(&[da[150], db[150]]).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("by step {}", da[150].steps)),
            "{err}"
        );
    }
}

const CHILD_ENV: &str = "VMEM_LOCKSTEP_CHILD_SEED";

/// The child rank of the cross-process test: with `VMEM_LOCKSTEP_CHILD_SEED` set, runs the
/// workload on its own manager and prints each call's digest to stdout (the pipe to the
/// parent). Run directly, it checks that two runs in one process agree.
#[test]
fn lockstep_child() {
    let setup = Setup {
        backend: Backendkind::Host,
        overlap: true,
        deferred: false,
    };
    match std::env::var(CHILD_ENV) {
        Ok(seed) => {
            let seed: u64 = seed.parse().unwrap();
            for d in run(&manager(setup), seed, 300, false, None) {
                let [v, s, c] = d.to_words();
                println!("DIGEST {v} {s} {c}");
            }
        }
        Err(_) => {
            let a = run(&manager(setup), 5, 300, false, None);
            let b = run(&manager(setup), 5, 300, true, None);
            assert_eq!(first_mismatch(&a, &b), None);
        }
    }
}

#[test]
fn two_processes_with_the_same_calls_agree() {
    let setup = Setup {
        backend: Backendkind::Host,
        overlap: true,
        deferred: false,
    };
    let seed = 11;
    let exe = std::env::current_exe().unwrap();
    let child = Command::new(exe)
        .args([
            "lockstep_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, seed.to_string())
        .output()
        .unwrap();
    assert!(child.status.success(), "child failed: {child:?}");
    let theirs: Vec<DecisionDigest> = String::from_utf8(child.stdout)
        .unwrap()
        .lines()
        // The harness may print "test lockstep_child ... " ahead of the first line.
        .filter_map(|l| l.split_once("DIGEST ").map(|(_, d)| d))
        .map(|l| {
            let w: Vec<u64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
            DecisionDigest::from_words([w[0], w[1], w[2]])
        })
        .collect();
    let ours = run(&manager(setup), seed, 300, true, None);
    assert_eq!(theirs.len(), ours.len(), "the child reported every call");
    assert_eq!(first_mismatch(&ours, &theirs), None);
    // And a child with another seed does not agree (the pipe carries real digests).
    let other = run(&manager(setup), seed + 1, 300, true, None);
    assert_ne!(other.last(), theirs.last());
}

/// A manager with prefix sharing on (host memory: sharing maps a page at two addresses).
fn sharing_manager() -> KvCacheManager {
    let cfg = small_kv(2, BATCH, 4096, KIB64)
        .memory_cap(256 * KIB64)
        .overlap(false)
        .eager_tokens(0)
        .prefix_cache(Some(64 * KIB64))
        .build();
    KvCacheManager::init(Arc::new(HostBackend::new().unwrap()), cfg).unwrap()
}

/// Both ranks prefill and publish the same 1,024-token prompt, free it, and admit a second
/// request: what every rank does before the call under test.
fn published(kv: &KvCacheManager, prompt: &[u32]) -> usize {
    let a = kv.alloc_reqid().unwrap();
    let mut lens = vec![0u64; BATCH];
    lens[a] = prompt.len() as u64;
    kv.step(&lens).unwrap();
    assert!(kv.publish_prefix(a, prompt).unwrap() > 0);
    kv.free_reqid(a).unwrap();
    kv.alloc_reqid().unwrap()
}

/// A rank that adopts a cached prefix and one that does not (or adopts another prompt) hold
/// different digests from that call on (before, adoptions were not in the digest: equal
/// digests, and the next step's page counts are equal too). Equal adoptions stay equal.
#[test]
fn a_prefix_adoption_shows_in_the_digest() {
    let prompt: Vec<u32> = (0..1024).collect();
    let other: Vec<u32> = (5000..6024).collect();
    let (a, b, c) = (sharing_manager(), sharing_manager(), sharing_manager());
    let (ra, rb, rc) = (
        published(&a, &prompt),
        published(&b, &prompt),
        published(&c, &prompt),
    );
    assert_eq!(a.decision_digest(), b.decision_digest());
    assert_eq!(a.adopt_prefix(ra, &prompt).unwrap(), 512 + 256);
    assert_eq!(c.adopt_prefix(rc, &prompt).unwrap(), 768);
    assert_eq!(
        a.decision_digest(),
        c.decision_digest(),
        "the same adoption"
    );
    assert_ne!(
        a.decision_digest(),
        b.decision_digest(),
        "an adoption against none"
    );
    assert_eq!(b.adopt_prefix(rb, &other).unwrap(), 0);
    assert_ne!(
        a.decision_digest(),
        b.decision_digest(),
        "768 tokens against 0"
    );
    // And after the step to the same length, which maps the same pages on both.
    let mut lens = vec![0u64; BATCH];
    lens[ra] = 1024;
    a.step(&lens).unwrap();
    b.step(&lens).unwrap();
    assert_ne!(a.decision_digest(), b.decision_digest());
}

/// Every call that changes what is mapped, cached or may be created is in the digest: made
/// on one rank only, it shows.
#[test]
fn every_call_that_changes_the_mapping_shows_in_the_digest() {
    let prompt: Vec<u32> = (0..1024).collect();
    let second: Vec<u32> = (9000..10024).collect();
    type Call = fn(&KvCacheManager, usize, &[u32]);
    let calls: [(&str, Call); 10] = [
        ("publish_prefix", |kv, r, p| {
            kv.publish_prefix(r, p).unwrap();
        }),
        ("map_ahead", |kv, r, _| {
            kv.map_ahead(r, 2000).unwrap();
        }),
        ("reserve_physical", |kv, _, _| {
            kv.reserve_physical(64 * KIB64).unwrap();
        }),
        ("set_memory_cap", |kv, _, _| {
            kv.set_memory_cap(128 * KIB64).unwrap();
        }),
        ("shrink", |kv, _, _| {
            kv.shrink(u64::MAX).unwrap();
        }),
        ("reclaim_inactive", |kv, _, _| {
            kv.reclaim_inactive().unwrap();
        }),
        ("release_free_pages", |kv, _, _| {
            kv.release_free_pages().unwrap();
        }),
        ("sleep", |kv, _, _| {
            kv.sleep(true).unwrap();
        }),
        ("wake", |kv, _, _| kv.wake()),
        ("set_deferred_reclaim", |kv, _, _| {
            kv.set_deferred_reclaim(false)
        }),
    ];
    for (name, call) in calls {
        let (a, b) = (sharing_manager(), sharing_manager());
        let (ra, rb) = (published(&a, &prompt), published(&b, &prompt));
        assert_eq!(ra, rb);
        // A second prompt computed on both: something for publish_prefix to cache.
        let mut lens = vec![0u64; BATCH];
        lens[ra] = 1024;
        a.step(&lens).unwrap();
        b.step(&lens).unwrap();
        assert_eq!(a.decision_digest(), b.decision_digest(), "{name}");
        call(&a, ra, &second);
        assert_ne!(
            a.decision_digest(),
            b.decision_digest(),
            "{name} on one rank"
        );
        call(&b, rb, &second);
        assert_eq!(a.decision_digest(), b.decision_digest(), "{name} on both");
    }
}

/// `check` of no digests at all is an error (before, it passed: nothing differed), and a
/// divergence message shows values that differ: two ranks whose digests differ only in
/// their call counts (before: "0x...05 ... 0x...05", the same value twice).
#[test]
fn check_refuses_no_digests_and_a_divergence_shows_what_differs() {
    let d = DecisionDigest::from_words([5, 3, 7]);
    assert!(matches!(d.check(&[]), Err(VmemError::InvalidConfig(_))));
    let other = DecisionDigest::from_words([5, 3, 8]);
    let err = d.check(&[d, other]).unwrap_err();
    match &err {
        VmemError::LockstepDivergence {
            rank, ours, theirs, ..
        } => {
            assert_eq!((*rank, *ours, *theirs), (1, d, other));
        }
        other => panic!("{other:?}"),
    }
    let m = err.to_string();
    assert!(m.contains("7 calls") && m.contains("8 calls"), "{m}");
}
