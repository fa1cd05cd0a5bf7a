// libFuzzer target for the HTTP request reader of `microspec serve` (src/server/request_reader.h):
// the bytes of one connection - one or more pipelined requests - arrive in pieces of a size taken
// from the input's first byte and go through the same RequestReader, with small limits so every
// limit is reached. Checks what the transport relies on: each request ends complete within the
// limits (target, fields, body) or failed with one of the statuses the transport answers; the
// reader consumes only bytes it was given and always makes progress or asks for more; nothing but
// those outcomes (crash, sanitizer report, exception) is acceptable.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "server/request_reader.h"

namespace {

using microspec::server::RequestReader;
using microspec::server::TransportLimits;

void require(bool ok) {
  if (!ok) __builtin_trap();
}

bool known_failure(int status) {
  switch (status) {
    case 400: case 413: case 414: case 431: case 501: case 505:
      return true;
    default:
      return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t piece = size_t(data[0] % 64) + 1;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  TransportLimits limits;
  limits.max_header_bytes = 512;
  limits.max_header_fields = 8;
  limits.max_target_bytes = 64;
  limits.max_body_bytes = 256;

  std::string in;  // bytes read and not yet consumed, as in the session
  size_t pos = 0;
  auto reader = std::make_unique<RequestReader>(limits);
  for (;;) {
    const size_t before = in.size();
    const size_t used = reader->feed(in);
    require(used <= before);
    in.erase(0, used);
    switch (reader->state()) {
      case RequestReader::State::Complete: {
        const auto& req = reader->request();
        require(req.body().size() <= limits.max_body_bytes);
        require(req.target().size() <= limits.max_target_bytes);
        require(size_t(std::distance(req.begin(), req.end())) <= limits.max_header_fields);
        require(req.version() == 10 || req.version() == 11);
        reader = std::make_unique<RequestReader>(limits);
        continue;
      }
      case RequestReader::State::Failed:
        require(known_failure(reader->status()) && !reader->message().empty());
        require(!reader->keep_connection() || reader->status() == 413);
        if (!reader->keep_connection()) return 0;
        reader = std::make_unique<RequestReader>(limits);
        continue;
      case RequestReader::State::NeedMore:
        // Bytes held back (a head, a chunk header still arriving) stay within the head limit.
        require(in.size() <= limits.max_header_bytes);
        break;
    }
    if (pos >= bytes.size()) {
      reader->end_of_input();
      require(reader->state() != RequestReader::State::Complete);
      return 0;
    }
    const size_t n = std::min(piece, bytes.size() - pos);
    in.append(bytes.data() + pos, n);
    pos += n;
  }
}
