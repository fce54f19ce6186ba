#pragma once
// gpt/data.hpp: a byte-level text corpus, split into training and validation text, and the
// batches a step trains on.
//
// The default corpus is the English text of Debian's `fortunes` package (quotations, jokes,
// definitions; scripts/setup.sh installs it): every data file in /usr/share/games/fortunes, in
// name order. Any other text file can be given instead.
//
// A global batch is a pure function of (seed, step): sequence g of step s starts at a
// pseudo-random offset of the training text. Rank r of N trains on sequences [r*B/N, (r+1)*B/N)
// of it, so any number of ranks sees the same global batch: what makes N-rank and one-rank runs
// comparable step by step.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fsdp/core/error.hpp>

namespace gpt {

inline const char* default_corpus_dir = "/usr/share/games/fortunes";

struct corpus {
  std::string name;        // where it came from
  std::string text;        // all of it
  std::size_t train_end;   // text[0, train_end) trains, the rest validates
};

//! Reads `path` (a file, or a directory whose files are concatenated in name order, skipping the
//! fortune index files `*.dat` and the `*.u8` links). The last `val_fraction` is validation text.
//! Throws fsdp::error naming the path when it is missing or too short for `seq`.
inline corpus load_corpus(const std::string& path, int seq, double val_fraction = 0.1) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const auto ext = e.path().extension().string();
      if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  }
  if (files.empty())
    throw fsdp::error(fsdp::errc::invalid_argument,
                      "no text at '" + path + "'" +
                          (path == default_corpus_dir ? " (the default corpus: install Debian's fortunes package, as "
                                                        "scripts/setup.sh does, or pass --data FILE)"
                                                      : ""));
  corpus c{path, {}, 0};
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    c.text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::size_t need = 4 * (static_cast<std::size_t>(seq) + 1);
  c.train_end = static_cast<std::size_t>(static_cast<double>(c.text.size()) * (1.0 - val_fraction));
  if (c.train_end < need || c.text.size() - c.train_end < need)
    throw fsdp::error(fsdp::errc::invalid_argument, "'" + path + "' has " + std::to_string(c.text.size()) +
                                                        " bytes: too little text for sequences of " + std::to_string(seq) +
                                                        " (need " + std::to_string(need) + " for training and for validation)");
  return c;
}

//! Inputs and next-byte targets of B sequences of T bytes, [B][T] each.
struct batch {
  std::vector<std::uint8_t> tokens, targets;
};

inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

//! Sequences [first, first + count) of the global batch `index` (a step, or an evaluation
//! batch) drawn from text[begin, end).
inline batch make_batch(const corpus& c, bool validation, std::uint64_t seed, std::uint64_t index, int first, int count,
                        int seq) {
  const std::size_t begin = validation ? c.train_end : 0, end = validation ? c.text.size() : c.train_end;
  const std::size_t starts = end - begin - static_cast<std::size_t>(seq) - 1;  // > 0, load_corpus checked
  batch b;
  for (int s = first; s < first + count; ++s) {
    const std::uint64_t key = mix(mix(seed * 2 + (validation ? 1 : 0)) ^ mix(index) * 31 ^ static_cast<std::uint64_t>(s));
    const std::size_t at = begin + static_cast<std::size_t>(key % starts);
    for (int t = 0; t < seq; ++t) {
      b.tokens.push_back(static_cast<std::uint8_t>(c.text[at + static_cast<std::size_t>(t)]));
      b.targets.push_back(static_cast<std::uint8_t>(c.text[at + static_cast<std::size_t>(t) + 1]));
    }
  }
  return b;
}

}  // namespace gpt
