// Byte-level BPE tokenizer (GGUF tokenizer.ggml.model = "gpt2": SmolLM2, Llama 3, Qwen2).
// Text is split into words by the pre-tokenizer regexes that tokenizer.ggml.pre names (PCRE2,
// UTF + UCP), each word's bytes are mapped to printable code points (GPT-2's byte-to-unicode
// table), and adjacent symbols are merged by merge rank (lowest first) until none applies.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

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

// White_Space as llama.cpp's pre-tokenizer sees it (PCRE2's \s leaves out U+0085), written as
// the inside of a character class.
#define MS_WS            \
  "\\t\\n\\x{0B}\\f\\r " \
  "\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

// The GPT-2 pattern: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
constexpr const char* kGpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" MS_WS
                              "\\p{L}\\p{N}]+|[" MS_WS "]+(?![^" MS_WS "])|[" MS_WS "]+";
// Llama 3: case-insensitive contractions, an optional non-letter before letters, digits in
// groups of up to three, punctuation runs with trailing newlines, newline runs.
constexpr const char* kLlama3 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^" MS_WS "\\p{L}\\p{N}]+[\\r\\n]*|[" MS_WS "]*[\\r\\n]+|[" MS_WS "]+(?![^" MS_WS
    "])|[" MS_WS "]+";
// Qwen2: as Llama 3 but single digits.
constexpr const char* kQwen2 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^" MS_WS "\\p{L}\\p{N}]+[\\r\\n]*|[" MS_WS "]*[\\r\\n]+|[" MS_WS "]+(?![^" MS_WS "])|[" MS_WS
    "]+";
#undef MS_WS

struct PreTokenizer {
  std::vector<const char*> patterns;  // applied in order, each splitting the pieces of the last
  bool ignore_merges = false;         // a word that is already a token is emitted whole
  bool add_bos = false;               // default when the file has no add_bos_token
};

// Pre-tokenizer names as llama.cpp maps them (tokenizer.ggml.pre).
PreTokenizer pre_tokenizer_for(std::string_view pre, const std::string& file_name) {
  auto in = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), pre) != names.end();
  };
  if (pre.empty() || pre == "default") {
    return {{"[\\p{P}$+<=>^~|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false};
  }
  if (in({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"})) {
    return {{kLlama3}, true, true};
  }
  if (in({"qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"})) {
    return {{kQwen2}, false, false};
  }
  if (in({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"})) {
    return {{"\\p{N}", kGpt2}, false, false};
  }
  if (in({"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "mpt", "olmo", "jais",
          "trillion", "exaone4", "mellum"})) {
    return {{kGpt2}, false, false};
  }
  throw Error(file_name + ": unsupported pre-tokenizer '" + std::string(pre) + "'");
}

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using CodePtr = std::unique_ptr<pcre2_code, CodeDeleter>;
using MatchDataPtr = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

class BpeTokenizer final : public VocabTokenizer {
 public:
  explicit BpeTokenizer(const GgufFile& file);
  std::string token_to_piece(int32_t id, bool special) const override;

 private:
  void encode_fragment(std::string_view text, bool after_special, std::vector<int32_t>& out) const override;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  int32_t merge_rank(std::string_view left, std::string_view right, std::string& key) const;
  std::string_view merge_key(size_t i) const {
    return std::string_view(merges_arena_).substr(merge_spans_[i].first, merge_spans_[i].second);
  }

  std::vector<CodePtr> regexes_;  // pre-tokenizer patterns, applied in order
  bool ignore_merges_ = false;
  std::string merges_arena_;                                // all merge lines "left right", concatenated
  std::vector<std::pair<uint32_t, uint32_t>> merge_spans_;  // [n_merges] (offset, length) in the arena
  std::vector<uint64_t> merge_slots_;                       // index over merge lines -> rank
  std::array<std::string, 256> byte_chars_;  // [256] UTF-8 of the code point standing for each byte
  std::array<int16_t, 324> char_bytes_{};    // [324] byte a code point stands for, or -1
};

BpeTokenizer::BpeTokenizer(const GgufFile& file) {
  const std::string pre(file.get_string_opt("tokenizer.ggml.pre").value_or(""));
  const PreTokenizer pt = pre_tokenizer_for(pre, file.name());
  ignore_merges_ = pt.ignore_merges;
  load_common(file, Defaults{.bos = -1, .eos = -1, .unk = -1, .add_bos = pt.add_bos});

  for (const char* pattern : pt.patterns) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw Error(std::string("pre-tokenizer regex does not compile at ") + std::to_string(err_off) + ": " +
                  reinterpret_cast<const char*>(msg));
    }
    // JIT is an optimisation only; pcre2_match falls back to the interpreter without it.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    regexes_.emplace_back(code);
  }

  const std::vector<std::string_view>& merges = file.get_string_array("tokenizer.ggml.merges");
  size_t total = 0;
  for (std::string_view m : merges) total += m.size();
  merges_arena_.reserve(total);
  merge_spans_.reserve(merges.size());
  for (std::string_view m : merges) {
    if (merges_arena_.size() + m.size() > UINT32_MAX)
      throw Error(file.name() + ": tokenizer.ggml.merges is too large");
    merge_spans_.emplace_back(static_cast<uint32_t>(merges_arena_.size()), static_cast<uint32_t>(m.size()));
    merges_arena_.append(m);
  }
  index_build(merge_slots_, merge_spans_.size(), [this](size_t i) { return merge_key(i); });

  // GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the other 68
  // bytes take code points 256, 257, ... in byte order.
  char_bytes_.fill(-1);
  int next_extra = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : next_extra++;
    byte_chars_[b].clear();
    utf8::append(static_cast<uint32_t>(cp), byte_chars_[b]);
    char_bytes_[cp] = static_cast<int16_t>(b);
  }
}

int32_t BpeTokenizer::merge_rank(std::string_view left, std::string_view right, std::string& key) const {
  key.assign(left);
  key.push_back(' ');
  key.append(right);
  return index_find(merge_slots_, key, [this](size_t i) { return merge_key(i); });
}

void BpeTokenizer::encode_fragment(std::string_view text, bool, std::vector<int32_t>& out) const {
  thread_local std::string norm;     // [bytes] text as llama.cpp re-encodes it
  thread_local std::string subject;  // [bytes] norm with surrogates replaced, for PCRE2
  thread_local std::vector<std::pair<size_t, size_t>> pieces, next;  // [pieces] byte ranges of norm
  thread_local std::string word;  // [bytes] one piece mapped through the byte table
  thread_local MatchDataPtr match(pcre2_match_data_create(1, nullptr));
  if (!match) throw Error("out of memory creating regex match data");

  bool has_surrogates = false;
  utf8::normalize_lenient(text, norm, has_surrogates);
  const std::string* subj = &norm;
  if (has_surrogates) {
    // PCRE2 rejects surrogates in UTF mode. U+E000 has the same length and, like a surrogate,
    // is neither letter, number nor space, so the split is unchanged.
    subject = norm;
    for (size_t i = 0; i + 2 < subject.size(); ++i) {
      if (static_cast<uint8_t>(subject[i]) == 0xED && static_cast<uint8_t>(subject[i + 1]) >= 0xA0) {
        subject[i] = static_cast<char>(0xEE), subject[i + 1] = static_cast<char>(0x80),
        subject[i + 2] = static_cast<char>(0x80);
        i += 2;
      }
    }
    subj = &subject;
  }

  pieces.assign(1, {0, norm.size()});
  const auto* base = reinterpret_cast<PCRE2_SPTR>(subj->data());
  for (const CodePtr& re : regexes_) {
    next.clear();
    for (const auto& [a, b] : pieces) {
      size_t gap = a, search = a;
      while (search < b) {
        const int rc =
            pcre2_match(re.get(), base + a, b - a, search - a, PCRE2_NO_UTF_CHECK, match.get(), nullptr);
        if (rc < 0) {
          if (rc != PCRE2_ERROR_NOMATCH)
            throw Error("pre-tokenizer regex failed (PCRE2 error " + std::to_string(rc) + ")");
          break;
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match.get());
        const size_t ms = a + ov[0], me = a + ov[1];
        if (me == ms) {  // empty match: step over one character
          search = ms + utf8::lead_length(static_cast<uint8_t>((*subj)[ms]));
          continue;
        }
        if (ms > gap) next.emplace_back(gap, ms);
        next.emplace_back(ms, me);
        gap = search = me;
      }
      if (gap < b) next.emplace_back(gap, b);
    }
    pieces.swap(next);
  }

  for (const auto& [a, b] : pieces) {
    word.clear();
    for (size_t i = a; i < b; ++i) word += byte_chars_[static_cast<uint8_t>(norm[i])];
    encode_word(word, out);
  }
  trim_scratch(norm);
  trim_scratch(subject);
  trim_scratch(pieces);
  trim_scratch(next);
  trim_scratch(word);
}

void BpeTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  // Symbol indices and offsets are 32-bit.
  if (word.size() > static_cast<size_t>(INT32_MAX))
    throw Error("text too long to tokenize (over 2 GiB without a break)");
  if (ignore_merges_) {
    const int32_t id = find_token(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  thread_local std::vector<MergeSymbol> syms;  // [characters of the word]
  thread_local std::vector<MergePair> heap;    // [pending pairs]
  thread_local std::string key;                // scratch for merge lookups
  syms.clear();
  heap.clear();
  split_utf8_symbols(word, syms);
  auto text_of = [&](const MergeSymbol& sym) { return word.substr(sym.offset, sym.length); };
  // Merge priority: the earlier a merge is listed, the sooner it applies.
  merge_pairs(syms, heap, [&](const MergeSymbol& l, const MergeSymbol& r, double* priority) {
    const int32_t rank = merge_rank(text_of(l), text_of(r), key);
    if (rank < 0) return false;
    *priority = -static_cast<double>(rank);
    return true;
  });

  for (int32_t i = 0; i != -1; i = syms[i].next) {
    const std::string_view piece = text_of(syms[i]);
    const int32_t id = find_token(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    // A merge produced a string the vocabulary lacks: fall back to single-byte entries, as
    // llama.cpp does (bytes without an entry are dropped).
    for (char c : piece) {
      const int32_t byte_id = find_token(std::string_view(&c, 1));
      if (byte_id >= 0) out.push_back(byte_id);
    }
  }
  trim_scratch(syms);
  trim_scratch(heap);
}

std::string BpeTokenizer::token_to_piece(int32_t id, bool special) const {
  check_id(id);
  const std::string& text = tokens_[id];
  switch (types_[id]) {
    case TokenType::Control:
    case TokenType::Unknown:
      return special ? text : std::string();
    case TokenType::UserDefined:
      return text;
    case TokenType::Normal: {
      thread_local std::string norm;
      bool has_surrogates = false;
      utf8::normalize_lenient(text, norm, has_surrogates);
      std::string out;
      out.reserve(norm.size());
      for (size_t i = 0; i < norm.size();) {
        const size_t start = i;
        const uint32_t cp = utf8::next(norm.data(), i);
        if (cp < char_bytes_.size() && char_bytes_[cp] >= 0) {
          out.push_back(static_cast<char>(char_bytes_[cp]));
          continue;
        }
        // A character outside the byte table: shown the way llama.cpp shows it.
        static constexpr char kHex[] = "0123456789abcdef";
        out += "[UNK_BYTE_0x";
        for (size_t k = start; k < i; ++k) {
          const auto b = static_cast<uint8_t>(norm[k]);
          out.push_back(kHex[b >> 4]);
          out.push_back(kHex[b & 15]);
        }
        out += text;
        out += "]";
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

std::unique_ptr<Tokenizer> make_bpe_tokenizer(const GgufFile& file) {
  return std::make_unique<BpeTokenizer>(file);
}

}  // namespace microspec::tok
