#pragma once
//! \file Compiler glue shared by every header.

//! Marks a function callable from host and (under nvcc) device code.
#if defined(__CUDACC__)
#define FSDP_HOST_DEVICE __host__ __device__
#else
#define FSDP_HOST_DEVICE
#endif
