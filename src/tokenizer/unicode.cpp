#include "tokenizer/unicode.h"

namespace microspec::utf8 {

void append(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void normalize_lenient(std::string_view in, std::string& out, bool& has_surrogates) {
  out.clear();
  has_surrogates = false;
  const auto* s = reinterpret_cast<const uint8_t*>(in.data());
  const size_t n = in.size();
  auto cont = [&](size_t j) { return j < n && (s[j] & 0xC0) == 0x80; };
  size_t i = 0;
  while (i < n) {
    const uint8_t b0 = s[i];
    uint32_t cp = kReplacement;
    size_t len = 1;
    if (b0 < 0x80) {
      cp = b0;
    } else if ((b0 & 0x40) == 0) {
      // stray continuation byte
    } else if ((b0 & 0x20) == 0) {
      if (cont(i + 1)) {
        cp = ((b0 & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
        len = 2;
      }
    } else if ((b0 & 0x10) == 0) {
      if (cont(i + 1) && cont(i + 2)) {
        cp = ((b0 & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
        len = 3;
      }
    } else if ((b0 & 0x08) == 0) {
      if (cont(i + 1) && cont(i + 2) && cont(i + 3)) {
        cp = ((b0 & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) |
             (s[i + 3] & 0x3Fu);
        len = 4;
        if (cp > 0x10FFFF) cp = kReplacement;
      }
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) has_surrogates = true;
    append(cp, out);
    i += len;
  }
}

int check_sequence(const uint8_t* s, size_t avail, size_t* subpart) {
  const uint8_t b0 = s[0];
  if (b0 < 0x80) return 1;
  size_t len = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 == 0xE0) {
    len = 3, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    len = 3;
  } else if (b0 == 0xED) {
    len = 3, hi = 0x9F;
  } else if (b0 == 0xF0) {
    len = 4, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    len = 4;
  } else if (b0 == 0xF4) {
    len = 4, hi = 0x8F;
  } else {
    *subpart = 1;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (k >= avail) return -1;
    const uint8_t b = s[k];
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
    if (!ok) {
      *subpart = k;
      return 0;
    }
  }
  return static_cast<int>(len);
}

}  // namespace microspec::utf8
