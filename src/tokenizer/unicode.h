#pragma once
// UTF-8 helpers for the tokenizers. Two decoders on purpose: a lenient one that reproduces how
// llama.cpp's tokenizers read bytes (so token ids match it on malformed input), and a strict one
// (Unicode's "maximal subpart" rule) for text shown to people.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace microspec::utf8 {

constexpr uint32_t kReplacement = 0xFFFD;

// Sequence length implied by a lead byte, without validation: 1 for ASCII and for stray
// continuation bytes, else 2/3/4 from the high bits. SentencePiece-style splitting uses this.
inline size_t lead_length(uint8_t b) {
  static constexpr uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[b >> 4];
}

// Appends the UTF-8 form of cp (< 0x110000; surrogates are encoded like any other value).
void append(uint32_t cp, std::string& out);

// Re-encodes text the way llama.cpp's byte-level BPE sees it: each well-formed-looking sequence
// (lead byte plus the right number of continuation bytes, with no check for overlong forms or
// surrogates) becomes its code point, re-encoded canonically; every other byte becomes U+FFFD.
// Values above U+10FFFF (llama.cpp aborts on them) also become U+FFFD.
// `out` receives the result; `has_surrogates` tells whether a surrogate code point was produced.
void normalize_lenient(std::string_view in, std::string& out, bool& has_surrogates);

// Decodes the next code point of valid UTF-8 (as produced by append/normalize_lenient).
inline uint32_t next(const char* s, size_t& i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) {
    i += 1;
    return b0;
  }
  const size_t n = lead_length(b0);
  uint32_t cp = b0 & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

// Strict validation: length of the well-formed sequence starting at s[0] (1..4), or 0 when the
// bytes there are ill-formed; *subpart receives the length of the maximal ill-formed subpart to
// replace with one U+FFFD. Returns -1 when `avail` bytes are a valid but incomplete prefix.
int check_sequence(const uint8_t* s, size_t avail, size_t* subpart);

}  // namespace microspec::utf8
