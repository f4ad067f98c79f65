//! What a GEMM is, independent of how it runs: the element types, the operation (a linear
//! layer's forward and its two backward shapes) and the full shape of one product
//! (`GemmSpec`), which plans and tuning choices are keyed by.

use cudarc::cublaslt::sys;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    F32,
    BF16,
    F16,
}

impl ElemType {
    pub(crate) fn cuda(self) -> sys::cudaDataType {
        match self {
            ElemType::F32 => sys::cudaDataType::CUDA_R_32F,
            ElemType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            ElemType::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }
    pub fn of(d: crate::model::DType) -> ElemType {
        match d {
            crate::model::DType::BF16 => ElemType::BF16,
            crate::model::DType::F16 => ElemType::F16,
            _ => ElemType::F32,
        }
    }
    pub fn size(self) -> usize {
        match self {
            ElemType::F32 => 4,
            _ => 2,
        }
    }
}

/// Which product (module doc); row-major shapes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GemmOp {
    /// `D[rows, n] = A[rows, k] · W[n, k]ᵀ`
    #[default]
    Linear,
    /// `D[rows, n] = A[rows, k] · W[k, n]`
    Dx,
    /// `D[rows, n] = A[k, rows]ᵀ · W[k, n]`
    Dw,
}

/// One GEMM shape and its numeric choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmSpec {
    pub op: GemmOp,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    /// row stride of D (≥ n)
    pub ldd: usize,
    /// row strides of A and W (0: packed)
    pub lda: usize,
    pub ldw: usize,
    pub a: ElemType,
    pub w: ElemType,
    pub d: ElemType,
    pub accumulate: bool,
    pub tf32: bool,
    /// One algorithm for the shape whatever `rows`, without split-K: a row's result does
    /// not depend on how many rows share the product (`GpuOptions::batch_invariant`).
    pub batch_invariant: bool,
}

impl GemmSpec {
    /// `D[rows, n] (+)= A[rows, k] · W[n, k]ᵀ` with A and W of type `ab`, packed; D's rows
    /// `ldd` apart.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        rows: usize,
        n: usize,
        k: usize,
        ab: ElemType,
        d: ElemType,
        ldd: usize,
        accumulate: bool,
        tf32: bool,
    ) -> GemmSpec {
        GemmSpec {
            op: GemmOp::Linear,
            rows,
            n,
            k,
            ldd,
            lda: 0,
            ldw: 0,
            a: ab,
            w: ab,
            d,
            accumulate,
            tf32,
            batch_invariant: false,
        }
    }

    /// The same product, batch-invariant or not (`batch_invariant`).
    pub fn invariant(self, on: bool) -> GemmSpec {
        GemmSpec {
            batch_invariant: on,
            ..self
        }
    }

    /// Whether cuBLAS transposes them, and the column-major shapes (rows, cols, ld), of
    /// cuBLAS's D = op(A)·op(B) with A = our W, B = our A (module doc).
    pub(crate) fn operands(&self) -> ([i32; 2], [(usize, usize, usize); 2]) {
        let s = self;
        let ld = |given: usize, packed: usize| if given == 0 { packed } else { given };
        match s.op {
            GemmOp::Linear => (
                [1, 0],
                [(s.k, s.n, ld(s.ldw, s.k)), (s.k, s.rows, ld(s.lda, s.k))],
            ),
            GemmOp::Dx => (
                [0, 0],
                [(s.n, s.k, ld(s.ldw, s.n)), (s.k, s.rows, ld(s.lda, s.k))],
            ),
            GemmOp::Dw => (
                [0, 1],
                [(s.n, s.k, ld(s.ldw, s.n)), (s.rows, s.k, ld(s.lda, s.rows))],
            ),
        }
    }
}
