// Thread-block clusters (Hopper, sm_90 and newer): the blocks of a cluster run at once on
// one GPC, meet at a cluster barrier, and read each other's shared memory. Used by the
// hardware probes (kernels/probes.cu).
#if __CUDA_ARCH__ >= 900

// Every thread of every block of the cluster meets here; memory written before is seen
// after (release/acquire at cluster scope, for shared and global memory).
__device__ __forceinline__ void cl_meet() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n\t"
        "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// This block's rank in its cluster, and the cluster's size in blocks.
__device__ __forceinline__ unsigned cl_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cl_blocks() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// The float at the shared-memory address of `p`, in block `rank` of this cluster.
__device__ __forceinline__ float cl_load(const float* p, unsigned rank) {
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

#endif
