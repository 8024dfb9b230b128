//! A decode iteration shaped like Llama-3-8B, run over a vmem KV cache: per layer, cuBLAS
//! GEMMs (QKV, O, gate/up, down; f32, batch B tokens) and two plain kernels compiled at run
//! time with nvrtc — one appends the new token's K and V (bf16) to the cache, one attends over
//! the cache — that address K and V only through the layer's [`LayerView`] (base + strides),
//! unchanged for either layout. Norms, rotary embeddings and activations are left out: they
//! cost little next to the GEMMs and the attention, and touch no KV memory.

use crate::cuda_err;
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;
use vmem::kvcache::LayerView;
use vmem::models::ModelSpec;
use vmem::{Result, VmemError};

const KERNELS: &str = r#"
__device__ __forceinline__ unsigned short f2bf(float x) { return (unsigned short)(__float_as_uint(x) >> 16); }
__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }

// grid (B), block (kv_heads * head_dim): write token len-1's K and V of request b.
extern "C" __global__ void append_kv(const float* qkv, unsigned long long k_base, unsigned long long v_base,
        unsigned long long sb, unsigned long long st, const unsigned long long* lens,
        int qkv_ld, int k_off, int v_off) {
    int b = blockIdx.x, i = threadIdx.x;
    unsigned long long len = lens[b];
    if (len == 0) return;
    unsigned long long at = b * sb + (len - 1) * st + i;
    ((unsigned short*)k_base)[at] = f2bf(qkv[b * qkv_ld + k_off + i]);
    ((unsigned short*)v_base)[at] = f2bf(qkv[b * qkv_ld + v_off + i]);
}

// grid (B, q_heads), block (head_dim): softmax(q K^T * scale) V over tokens 0..len-1.
extern "C" __global__ void attend(const float* qkv, unsigned long long k_base, unsigned long long v_base,
        unsigned long long sb, unsigned long long st, const unsigned long long* lens, float* out,
        int group, int qkv_ld, int out_ld, float scale) {
    __shared__ float partial[32];
    int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x, D = blockDim.x;
    unsigned long long len = lens[b];
    if (len == 0) { out[b * out_ld + h * D + d] = 0.0f; return; }
    int kvh = h / group;
    float q = qkv[b * qkv_ld + h * D + d] * scale;
    const unsigned short* K = (const unsigned short*)k_base + b * sb + kvh * D + d;
    const unsigned short* V = (const unsigned short*)v_base + b * sb + kvh * D + d;
    float m = -1e30f, l = 0.0f, acc = 0.0f;
    for (unsigned long long t = 0; t < len; t++) {
        float s = q * bf2f(K[t * st]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if ((d & 31) == 0) partial[d >> 5] = s;
        __syncthreads();
        s = 0.0f;
        for (int w = 0; w < (D >> 5); w++) s += partial[w];
        __syncthreads();
        float mn = fmaxf(m, s), c = __expf(m - mn), p = __expf(s - mn);
        l = l * c + p;
        acc = acc * c + p * bf2f(V[t * st]);
        m = mn;
    }
    out[b * out_ld + h * D + d] = acc / l;
}
"#;

/// The model whose per-layer shapes the decode step has (stated once, in vmem's models.rs).
pub const MODEL: ModelSpec = vmem::models::LLAMA_3_8B;
const HIDDEN: usize = MODEL.hidden;
const Q_HEADS: usize = MODEL.q_heads;
const KV_HEADS: usize = MODEL.kv_heads;
const HEAD_DIM: usize = MODEL.head_dim;
const INTER: usize = MODEL.intermediate;
const QKV: usize = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM;

fn blas_err(e: cudarc::cublas::result::CublasError) -> VmemError {
    VmemError::Cuda {
        op: "cublasSgemm",
        msg: format!("{e:?}"),
    }
}

/// One layer's weights (shared by all layers: the same bytes move as with distinct weights
/// of this size, which do not fit beside a 32-layer cache twice) and the activations.
#[derive(Debug)]
pub struct DecodeModel {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    append: CudaFunction,
    attend: CudaFunction,
    batch: usize,
    w_qkv: CudaSlice<f32>,
    w_o: CudaSlice<f32>,
    w_gate_up: CudaSlice<f32>,
    w_down: CudaSlice<f32>,
    x: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    h: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    lens: CudaSlice<u64>,
}

impl DecodeModel {
    /// Compiles the kernels, creates the cuBLAS handle and fills weights with small
    /// pseudo-random values (never zeros: zeros can run faster than real data).
    pub fn new(ordinal: usize, batch: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.default_stream();
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            KERNELS,
            cudarc::nvrtc::CompileOptions {
                arch: Some("compute_90"),
                ..Default::default()
            },
        )
        .map_err(|e| VmemError::Cuda {
            op: "nvrtcCompileProgram",
            msg: format!("{e:?}"),
        })?;
        let module = ctx.load_module(ptx).map_err(cuda_err("cuModuleLoadData"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err)?;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut weights = |n: usize, fan_in: usize| -> Result<CudaSlice<f32>> {
            let scale = 1.0 / (fan_in as f32).sqrt();
            let host: Vec<f32> = (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
                })
                .collect();
            stream.clone_htod(&host).map_err(cuda_err("cuMemcpyHtoD"))
        };
        let w_qkv = weights(HIDDEN * QKV, HIDDEN)?;
        let w_o = weights(HIDDEN * HIDDEN, HIDDEN)?;
        let w_gate_up = weights(HIDDEN * 2 * INTER, HIDDEN)?;
        let w_down = weights(INTER * HIDDEN, INTER)?;
        let x = weights(batch * HIDDEN, 1)?;
        let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(cuda_err("cuMemAlloc"));
        Ok(DecodeModel {
            append: module
                .load_function("append_kv")
                .map_err(cuda_err("cuModuleGetFunction"))?,
            attend: module
                .load_function("attend")
                .map_err(cuda_err("cuModuleGetFunction"))?,
            batch,
            w_qkv,
            w_o,
            w_gate_up,
            w_down,
            x,
            qkv: zeros(batch * QKV)?,
            attn: zeros(batch * HIDDEN)?,
            h: zeros(batch * HIDDEN)?,
            gate_up: zeros(batch * 2 * INTER)?,
            lens: stream
                .alloc_zeros::<u64>(batch)
                .map_err(cuda_err("cuMemAlloc"))?,
            blas,
            stream,
        })
    }

    /// Runs one decode iteration over every layer whose views are given (Llama-3-8B: 32),
    /// for requests of lengths `seq_lens` (0 = inactive; the new token is at `len - 1`), and
    /// waits for it.
    ///
    /// # Safety
    /// The kernels write token `len - 1` and read tokens `0..len` of every request `b` with
    /// `seq_lens[b] > 0` through the views' addresses and strides: those elements must be
    /// device memory mapped read/write in this device's context for the whole call (for
    /// views of a [`vmem::KvCacheManager`], a successful `step(seq_lens)` before the call and
    /// no unmapping during it), and nothing else may use them meanwhile.
    pub unsafe fn iteration(&mut self, views: &[LayerView], seq_lens: &[u64]) -> Result<()> {
        if seq_lens.len() != self.batch
            || views
                .iter()
                .any(|v| v.k.shape[2] != KV_HEADS || v.k.shape[3] != HEAD_DIM)
        {
            return Err(VmemError::InvalidConfig(format!(
                "decode model needs {} lengths and views of {KV_HEADS} KV heads x {HEAD_DIM}",
                self.batch
            )));
        }
        self.stream
            .memcpy_htod(seq_lens, &mut self.lens)
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        let b = self.batch as i32;
        for view in views {
            // qkv[B, QKV] = x[B, HIDDEN] . Wqkv[HIDDEN, QKV]
            gemm(
                &self.blas,
                self.batch,
                QKV,
                HIDDEN,
                &self.w_qkv,
                &self.x,
                HIDDEN,
                &mut self.qkv,
            )?;
            // K base, V base, and the strides of a request and of a token.
            let kv = [
                view.k.addr,
                view.v.addr,
                view.k.strides[0] as u64,
                view.k.strides[1] as u64,
            ];
            let (qkv_ld, k_off, v_off) = (
                QKV as i32,
                (Q_HEADS * HEAD_DIM) as i32,
                ((Q_HEADS + KV_HEADS) * HEAD_DIM) as i32,
            );
            let cfg = LaunchConfig {
                grid_dim: (b as u32, 1, 1),
                block_dim: ((KV_HEADS * HEAD_DIM) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = kv_launch(&self.stream, &self.append, &self.qkv, &kv, &self.lens);
            launch.arg(&qkv_ld).arg(&k_off).arg(&v_off);
            // SAFETY: the arguments match append_kv's parameters in order and type; every
            // address written is token len-1 of an active request, mapped by the caller's
            // contract.
            unsafe { launch.launch(cfg) }.map_err(cuda_err("cuLaunchKernel"))?;
            let (group, out_ld, scale) = (
                (Q_HEADS / KV_HEADS) as i32,
                HIDDEN as i32,
                1.0f32 / (HEAD_DIM as f32).sqrt(),
            );
            let cfg = LaunchConfig {
                grid_dim: (b as u32, Q_HEADS as u32, 1),
                block_dim: (HEAD_DIM as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = kv_launch(&self.stream, &self.attend, &self.qkv, &kv, &self.lens);
            launch.arg(&mut self.attn);
            launch.arg(&group).arg(&qkv_ld).arg(&out_ld).arg(&scale);
            // SAFETY: arguments match attend's parameters; it reads tokens 0..len-1 of active
            // requests, mapped by the caller's contract, and writes `attn`, B x HIDDEN floats.
            unsafe { launch.launch(cfg) }.map_err(cuda_err("cuLaunchKernel"))?;
            // h = attn . Wo; gate_up = h . Wgu; x = gate_up[:, :INTER] . Wdown
            gemm(
                &self.blas,
                self.batch,
                HIDDEN,
                HIDDEN,
                &self.w_o,
                &self.attn,
                HIDDEN,
                &mut self.h,
            )?;
            gemm(
                &self.blas,
                self.batch,
                2 * INTER,
                HIDDEN,
                &self.w_gate_up,
                &self.h,
                HIDDEN,
                &mut self.gate_up,
            )?;
            gemm(
                &self.blas,
                self.batch,
                HIDDEN,
                INTER,
                &self.w_down,
                &self.gate_up,
                2 * INTER,
                &mut self.x,
            )?;
        }
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}

/// `out[B, n] = input[B, k] . w[k, n]` on row-major buffers (cuBLAS computes the
/// column-major transpose: out^T = w^T . input^T). `ld_in` is input's row stride.
#[allow(clippy::too_many_arguments)]
fn gemm(
    blas: &CudaBlas,
    batch: usize,
    n: usize,
    k: usize,
    w: &CudaSlice<f32>,
    input: &CudaSlice<f32>,
    ld_in: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: batch as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: n as i32,
        ldb: ld_in as i32,
        beta: 0.0f32,
        ldc: n as i32,
    };
    // SAFETY: sizes agree with the buffers: w holds k x n floats, input B rows of ld_in >= k
    // floats, out B x n floats (allocated in `DecodeModel::new` for these shapes).
    unsafe { blas.gemm(cfg, w, input, out) }.map_err(blas_err)
}

/// Starts a launch of `func` (`append_kv` or `attend`) with the arguments both take first, in
/// their order: the qkv activations, `kv` (K base, V base, request stride, token stride) and
/// the lengths.
fn kv_launch<'a>(
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    qkv: &'a CudaSlice<f32>,
    kv: &'a [u64; 4],
    lens: &'a CudaSlice<u64>,
) -> LaunchArgs<'a> {
    let mut launch = stream.launch_builder(func);
    launch.arg(qkv);
    for word in kv {
        launch.arg(word);
    }
    launch.arg(lens);
    launch
}
