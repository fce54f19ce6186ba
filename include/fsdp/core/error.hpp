#pragma once
//! \file fsdp::error: the one exception type of the toolkit.

#include <stdexcept>
#include <string>
#include <string_view>

namespace fsdp {

//! What kind of failure an fsdp::error reports.
enum class errc {
  invalid_argument,   //!< bad value or shape handed in by the caller
  mismatch,           //!< ranks disagree (registration, collective arguments, unit order)
  order,              //!< hooks called out of order
  unsupported_dtype,  //!< a dtype the toolkit cannot shard or reduce
  timeout,            //!< a wait ran past its deadline (a peer is stuck or gone)
  peer_failure,       //!< another rank failed; this rank stopped because of it
  no_device,          //!< the requested device (e.g. CUDA) is absent
  checkpoint,         //!< a truncated or mismatched checkpoint
  non_finite,         //!< a nan or inf where a finite number is needed (a gradient norm)
  internal,           //!< a broken invariant inside fsdp
};

constexpr std::string_view to_string(errc c) noexcept {
  switch (c) {
    case errc::invalid_argument: return "invalid argument";
    case errc::mismatch: return "mismatch across ranks";
    case errc::order: return "hooks out of order";
    case errc::unsupported_dtype: return "unsupported dtype";
    case errc::timeout: return "timeout";
    case errc::peer_failure: return "peer failure";
    case errc::no_device: return "no device";
    case errc::checkpoint: return "checkpoint";
    case errc::non_finite: return "non-finite value";
    case errc::internal: return "internal error";
  }
  return "unknown";
}

//! Where an error happened; -1 (or empty) for "not applicable".
struct error_site {
  int rank = -1;
  int unit = -1;
  std::string param{};
};

//! The exception thrown by fsdp on bad input, disagreement between ranks, timeouts and peer
//! failures. what() reads "fsdp: <category>: [rank r, unit u, parameter 'p'] <message>".
class error : public std::runtime_error {
 public:
  error(errc code, std::string_view message, error_site site = {})
      : std::runtime_error(format(code, message, site)), code_(code), site_(std::move(site)) {}

  errc code() const noexcept { return code_; }
  int rank() const noexcept { return site_.rank; }
  int unit() const noexcept { return site_.unit; }
  const std::string& param() const noexcept { return site_.param; }

 private:
  static std::string format(errc code, std::string_view message, const error_site& s) {
    std::string out = "fsdp: ";
    out += to_string(code);
    out += ": ";
    std::string where;
    auto add = [&](const std::string& part) { where += where.empty() ? part : ", " + part; };
    if (s.rank >= 0) add("rank " + std::to_string(s.rank));
    if (s.unit >= 0) add("unit " + std::to_string(s.unit));
    if (!s.param.empty()) add("parameter '" + s.param + "'");
    if (!where.empty()) out += "[" + where + "] ";
    out += message;
    return out;
  }

  errc code_;
  error_site site_;
};

}  // namespace fsdp
