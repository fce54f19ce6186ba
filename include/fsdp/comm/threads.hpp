#pragma once
//! \file The `threads` backend: N ranks as threads of one process, collectives through shared
//! memory (comm/threads/: the world, one rank's communicator, the rendezvous where ranks meet,
//! the host's data phases, the link model, the CUDA sibling). This header is what users include.
#include "fsdp/comm/threads/world.hpp"  // defines: threads::world, threads::communicator, world_options, link_model
