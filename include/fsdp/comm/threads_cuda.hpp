#pragma once
//! \file Forwards to comm/threads/cuda_communicator.hpp (threads::cuda_communicator: the threads
//! backend over the CUDA device), kept so that existing includes keep working.
#include "fsdp/comm/threads/cuda_communicator.hpp"
