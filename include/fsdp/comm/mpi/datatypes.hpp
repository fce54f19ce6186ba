#pragma once
//! \file The MPI datatypes of fsdp's dtypes (bf16 and f16, absent from mpi.h, travel as 2-byte
//! types created once per process by mpi::environment) and MPI's error text.

#include <mpi.h>

#include <cstddef>
#include <string>

#include "fsdp/core/dtype.hpp"

namespace fsdp::mpi::detail {

inline std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

//! The MPI datatypes for bf16 and f16, created once per process.
struct half_types {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
};
inline half_types& halves() {
  static half_types h;
  return h;
}

inline MPI_Datatype mpi_type(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::bf16: return halves().bf16;
    case dtype::f16: return halves().f16;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_BYTE;
  }
  return MPI_DATATYPE_NULL;
}

}  // namespace fsdp::mpi::detail
