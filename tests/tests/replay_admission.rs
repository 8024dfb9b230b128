//! `ReplayConfig::admit_without_waiting`: the replay's scheduler admits a request beside running
//! ones only when its first step would not wait for the device (`KvMemory::step_would_wait`),
//! as an engine under async batching that keeps admissions from stalling its rounds.

use vmem::kvcache::{MemoryUsage, StepReport};
use vmem_replay::{replay, BlockMemory, KvMemory, ReplayConfig, TraceRequest};

/// Blocks whose step "would wait" from a free until the next iteration's compute (the pages a
/// free gives back come after the round in flight), counting the steps taken meanwhile.
struct AfterFree {
    blocks: BlockMemory,
    freed: bool,
    running: usize,
    steps_that_waited: u64,
}

impl KvMemory for AfterFree {
    fn max_batch(&self) -> usize {
        self.blocks.max_batch()
    }
    fn max_context(&self) -> u64 {
        self.blocks.max_context()
    }
    fn alloc_reqid(&mut self) -> vmem::Result<usize> {
        self.blocks.alloc_reqid()
    }
    fn free_reqid(&mut self, req: usize) -> vmem::Result<()> {
        self.freed = true;
        self.blocks.free_reqid(req)
    }
    fn step(&mut self, seq_lens: &[u64]) -> vmem::Result<StepReport> {
        let running = seq_lens.iter().filter(|&&l| l > 0).count();
        // A step that adds a request while a free's pages are not back waits.
        if self.freed && running > self.running && self.running > 0 {
            self.steps_that_waited += 1;
        }
        let r = self.blocks.step(seq_lens);
        if r.is_ok() {
            self.running = running;
        }
        r
    }
    fn usage(&self) -> MemoryUsage {
        self.blocks.usage()
    }
    fn compute(&mut self) {
        self.freed = false;
    }
    fn step_would_wait(&self, seq_lens: &[u64]) -> bool {
        self.freed && seq_lens.iter().filter(|&&l| l > 0).count() > self.running
    }
}

fn trace() -> Vec<TraceRequest> {
    (0..40)
        .map(|i| TraceRequest {
            arrival_s: 0.0,
            prompt_tokens: 50 + (i * 37) % 200,
            output_tokens: 5 + (i * 13) % 40,
            line: i as usize + 1,
        })
        .collect()
}

fn run(admit_without_waiting: bool) -> (u64, vmem_replay::ReplayStats) {
    // 16-token blocks of 1 KiB tokens, 4 ids, a budget of 40 blocks.
    let mut m = AfterFree {
        blocks: BlockMemory::new(1024, 16, 4, 4096, 40 * 16 * 1024).unwrap(),
        freed: false,
        running: 0,
        steps_that_waited: 0,
    };
    let cfg = ReplayConfig {
        offline: true,
        admit_without_waiting,
        ..ReplayConfig::default()
    };
    let stats = replay(&mut m, &trace(), &cfg, |_| {}).unwrap();
    (m.steps_that_waited, stats)
}

#[test]
fn admissions_wait_a_round_rather_than_stall_and_every_request_completes() {
    let (waited, eager) = run(false);
    assert!(
        waited > 0,
        "the trace must admit beside running requests right after frees"
    );
    let (none, patient) = run(true);
    assert_eq!(none, 0, "an admission stalled a round");
    assert_eq!((eager.completed, patient.completed), (40, 40));
    assert!(patient.iterations >= eager.iterations);
}
