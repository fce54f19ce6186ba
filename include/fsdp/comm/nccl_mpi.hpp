#pragma once
//! \file Forwards to comm/nccl/from_mpi.hpp (nccl::from_mpi: an NCCL communicator bootstrapped
//! over MPI), kept so that existing includes keep working.
#include "fsdp/comm/nccl/from_mpi.hpp"
