#pragma once
// xxHash, header-only: a fast, well-kept 64-bit hash (Debian's libxxhash-dev), for the checksums
// of initial values and checkpoints.
//
// GCC 12's AVX-512 intrinsics warn that their own _mm512_undefined_* values "may be used
// uninitialized" wherever xxHash's AVX-512 loop is inlined, which -march=native on an AVX-512
// CPU turns on (GCC bug 105593, fixed in GCC 13 by the same pragma inside the intrinsics'
// headers). Silenced here, around xxHash only.
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <xxhash.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
