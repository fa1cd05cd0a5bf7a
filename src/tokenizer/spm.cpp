// SentencePiece-style tokenizer (GGUF tokenizer.ggml.model = "llama", e.g. Gemma 3): spaces
// become U+2581, the text is split into UTF-8 characters, and the adjacent pair whose
// concatenation is the highest-scoring vocabulary entry is merged until no pair is in the
// vocabulary. Pieces that are not tokens fall back to <0xXX> byte tokens.
#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"
#include "util/error.h"

namespace microspec::tok {
namespace {

constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK

class SpmTokenizer final : public VocabTokenizer {
 public:
  explicit SpmTokenizer(const GgufFile& file);
  std::string token_to_piece(int32_t id, bool special) const override;

 private:
  void encode_fragment(std::string_view text, bool after_special, std::vector<int32_t>& out) const override;

  std::vector<float> scores_;               // [n_vocab] merge priority of each token
  std::array<int32_t, 256> byte_tokens_{};  // [256] token for each byte value, or -1
  bool add_space_prefix_ = true;
};

SpmTokenizer::SpmTokenizer(const GgufFile& file) {
  // llama.cpp's defaults for this tokenizer kind, used when the file does not say.
  load_common(file, Defaults{.bos = 1, .eos = 2, .unk = 0, .add_bos = true});
  add_space_prefix_ = file.get_bool_or("tokenizer.ggml.add_space_prefix", true);

  const size_t n = tokens_.size();
  scores_.assign(n, 0.0f);
  if (const GgufValue* v = file.find("tokenizer.ggml.scores")) {
    if (v->type == GgufType::ARRAY && v->elem_type == GgufType::F32) {
      scores_ = file.get_f32_array("tokenizer.ggml.scores");
    } else {
      const std::vector<int32_t> iscores = file.get_i32_array("tokenizer.ggml.scores");
      scores_.assign(iscores.begin(), iscores.end());
    }
    if (scores_.size() < n) {
      throw Error(file.name() + ": tokenizer.ggml.scores has " + std::to_string(scores_.size()) +
                  " entries for " + std::to_string(n) + " tokens");
    }
    scores_.resize(n);
  }

  static constexpr char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const char name[6] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
    int32_t id = find_token(std::string_view(name, 6));
    if (id < 0) id = find_token(std::string_view(reinterpret_cast<const char*>(&b), 1));
    // No byte token at all: the unknown token stands in (llama.cpp would abort here).
    byte_tokens_[b] = id >= 0 ? id : unk_id_;
  }
}

void SpmTokenizer::encode_fragment(std::string_view text, bool after_special,
                                   std::vector<int32_t>& out) const {
  thread_local std::string buf;                // [bytes] escaped text
  thread_local std::vector<MergeSymbol> syms;  // [characters]
  thread_local std::vector<MergePair> heap;    // [pending pairs]
  buf.clear();
  syms.clear();
  heap.clear();

  if (add_space_prefix_ && after_special) buf += kSpaceMarker;
  for (char c : text) {
    if (c == ' ') {
      buf += kSpaceMarker;
    } else {
      buf.push_back(c);
    }
  }
  if (buf.empty()) return;
  // Symbol indices and offsets are 32-bit.
  if (buf.size() > static_cast<size_t>(INT32_MAX))
    throw Error("text too long to tokenize (over 2 GiB without a break)");

  split_utf8_symbols(buf, syms);
  // Merge priority: the score of the token the pair forms.
  merge_pairs(syms, heap, [&](const MergeSymbol& l, const MergeSymbol& r, double* priority) {
    const int32_t id = find_token(std::string_view(buf.data() + l.offset, l.length + r.length));
    if (id < 0) return false;
    *priority = scores_[id];
    return true;
  });

  // Every merged symbol is a token by construction; single characters may not be, and then
  // their bytes are emitted as byte tokens.
  for (int32_t i = 0; i != -1; i = syms[i].next) {
    const MergeSymbol& s = syms[i];
    const int32_t id = find_token(std::string_view(buf.data() + s.offset, s.length));
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (uint32_t k = 0; k < s.length; ++k) {
      const int32_t byte_id = byte_tokens_[static_cast<uint8_t>(buf[s.offset + k])];
      if (byte_id >= 0) out.push_back(byte_id);
    }
  }
  trim_scratch(buf);
  trim_scratch(syms);
  trim_scratch(heap);
}

std::string SpmTokenizer::token_to_piece(int32_t id, bool special) const {
  check_id(id);
  const std::string& text = tokens_[id];
  switch (types_[id]) {
    case TokenType::Control:
    case TokenType::Unknown:
      return special ? text : std::string();
    case TokenType::UserDefined:
      return text;
    case TokenType::Normal: {
      std::string out;
      out.reserve(text.size());
      for (size_t i = 0; i < text.size();) {
        if (text.compare(i, kSpaceMarker.size(), kSpaceMarker) == 0) {
          out.push_back(' ');
          i += kSpaceMarker.size();
        } else {
          out.push_back(text[i++]);
        }
      }
      return out;
    }
    case TokenType::Byte:
      return byte_token_bytes(text);
    case TokenType::Undefined:
    case TokenType::Unused:
      break;
  }
  return std::string();
}

}  // namespace

std::unique_ptr<Tokenizer> make_spm_tokenizer(const GgufFile& file) {
  return std::make_unique<SpmTokenizer>(file);
}

}  // namespace microspec::tok
