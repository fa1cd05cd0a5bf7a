// Shared tokenizer machinery: loading the vocabulary from GGUF metadata, the token index,
// special-token splitting, end-of-generation detection and streaming UTF-8 output.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"
#include "util/error.h"

namespace microspec {

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& file) {
  const std::string_view model = file.get_string("tokenizer.ggml.model");
  if (model == "llama") return tok::make_spm_tokenizer(file);
  if (model == "gpt2") return tok::make_bpe_tokenizer(file);
  throw Error(file.name() + ": unsupported tokenizer model '" + std::string(model) +
              "' (supported: llama, gpt2)");
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool special) const {
  std::string out;
  for (int32_t id : ids) out += token_to_piece(id, special);
  return out;
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::find(eog_ids_.begin(), eog_ids_.end(), id) != eog_ids_.end();
}

int32_t Tokenizer::find_token(std::string_view text) const {
  return tok::index_find(index_slots_, text, [this](size_t i) -> std::string_view { return tokens_[i]; });
}

// ---------------------------------------------------------------------------------------------
// Utf8StreamDecoder

namespace {
constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";
}

std::string Utf8StreamDecoder::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  const auto* s = reinterpret_cast<const uint8_t*>(pending_.data());
  const size_t n = pending_.size();
  size_t i = 0;
  while (i < n) {
    size_t subpart = 0;
    const int len = utf8::check_sequence(s + i, n - i, &subpart);
    if (len < 0) break;  // incomplete: wait for more bytes
    if (len == 0) {
      out += kReplacementUtf8;
      i += subpart;
    } else {
      out.append(pending_, i, static_cast<size_t>(len));
      i += static_cast<size_t>(len);
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8StreamDecoder::flush() {
  std::string out = push({});
  // Whatever remains is one incomplete (hence ill-formed) sequence.
  if (!pending_.empty()) out += kReplacementUtf8;
  pending_.clear();
  return out;
}

namespace tok {

// ---------------------------------------------------------------------------------------------
// SpecialSplitter

void SpecialSplitter::build(const std::vector<std::string>& tokens, const std::vector<TokenType>& types) {
  entries_.clear();
  texts_.clear();
  for (size_t id = 0; id < tokens.size(); ++id) {
    const TokenType t = types[id];
    if (t != TokenType::Control && t != TokenType::UserDefined && t != TokenType::Unknown) continue;
    entries_.push_back(Entry{static_cast<int32_t>(id), static_cast<uint32_t>(tokens[id].size()), 0,
                             t != TokenType::UserDefined});
    texts_.push_back(tokens[id]);
  }
  std::vector<uint32_t> order(entries_.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    if (entries_[a].length != entries_[b].length) return entries_[a].length > entries_[b].length;
    return entries_[a].token < entries_[b].token;
  });
  for (uint32_t r = 0; r < order.size(); ++r) entries_[order[r]].rank = r;

  nodes_.assign(1, Node{});
  root_child_.fill(-1);
  for (size_t e = 0; e < entries_.size(); ++e) {
    const std::string& s = tokens[entries_[e].token];
    int32_t node = 0;
    for (size_t k = 0; k < s.size(); ++k) {
      const auto b = static_cast<uint8_t>(s[k]);
      int32_t child = nodes_[node].first_child;
      while (child >= 0 && nodes_[child].byte != b) child = nodes_[child].next_sibling;
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        Node fresh;
        fresh.byte = b;
        fresh.next_sibling = nodes_[node].first_child;
        nodes_.push_back(fresh);
        nodes_[node].first_child = child;
        if (node == 0) root_child_[b] = child;
      }
      node = child;
    }
    nodes_[node].entry = static_cast<int32_t>(e);
  }
}

void SpecialSplitter::split(std::string_view text, bool parse_special, std::vector<Fragment>& out) const {
  out.clear();
  const size_t n = text.size();
  if (n == 0) return;

  // Which special tokens occur at all: one pass with the trie. Memory stays O(n + tokens) even
  // for long runs of whitespace, where many tokens match at every position.
  thread_local std::vector<uint8_t> seen;    // [n entries] 1 once the entry was found in this text
  thread_local std::vector<uint32_t> found;  // [distinct entries found]
  seen.assign(entries_.size(), 0);
  found.clear();
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  for (size_t pos = 0; pos < n; ++pos) {
    int32_t node = root_child_[s[pos]];
    size_t p = pos;
    while (node >= 0) {
      const int32_t e = nodes_[node].entry;
      if (e >= 0 && !seen[e] && (parse_special || !entries_[e].needs_parse_special)) {
        seen[e] = 1;
        found.push_back(static_cast<uint32_t>(e));
      }
      if (++p == n) break;
      int32_t child = nodes_[node].first_child;
      while (child >= 0 && nodes_[child].byte != s[p]) child = nodes_[child].next_sibling;
      node = child;
    }
  }
  if (found.empty()) {
    out.push_back(Fragment{-1, 0, n});
    return;
  }

  // Longest tokens first, each claiming its leftmost occurrences that no earlier token covers.
  std::sort(found.begin(), found.end(),
            [this](uint32_t a, uint32_t b) { return entries_[a].rank < entries_[b].rank; });
  thread_local std::vector<uint8_t> taken;  // [n] 1 where a chosen special token covers the byte
  taken.assign(n, 0);
  thread_local std::vector<Fragment> chosen;
  chosen.clear();
  for (uint32_t e : found) {
    const Entry& entry = entries_[e];
    const std::string_view needle = texts_[e];
    for (size_t pos = text.find(needle); pos != std::string_view::npos;) {
      if (std::memchr(taken.data() + pos, 1, entry.length) != nullptr) {
        pos = text.find(needle, pos + 1);
        continue;
      }
      std::memset(taken.data() + pos, 1, entry.length);
      chosen.push_back(Fragment{entry.token, pos, entry.length});
      pos = text.find(needle, pos + entry.length);
    }
  }
  std::sort(chosen.begin(), chosen.end(),
            [](const Fragment& a, const Fragment& b) { return a.offset < b.offset; });
  size_t cursor = 0;
  for (const Fragment& f : chosen) {
    if (f.offset > cursor) out.push_back(Fragment{-1, cursor, f.offset - cursor});
    out.push_back(f);
    cursor = f.offset + f.length;
  }
  if (cursor < n) out.push_back(Fragment{-1, cursor, n - cursor});
  trim_scratch(taken);
  trim_scratch(chosen);
}

// ---------------------------------------------------------------------------------------------
// VocabTokenizer

namespace {

// Texts that end a turn in the chat formats llama.cpp knows; such tokens stop generation and
// are treated as control tokens even when the file says otherwise (as llama.cpp does).
constexpr std::string_view kEogTexts[] = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\xEF\xBD\x9C"
    "end\xE2\x96\x81"
    "of\xE2\x96\x81"
    "sentence\xEF\xBD\x9C>",
    "[e~[",
};
// Fill-in-the-middle markers llama.cpp also stops on (looked up by text when the file has no id).
constexpr std::string_view kFimPadTexts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
constexpr std::string_view kFimRepTexts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                             "<reponame>"};
constexpr std::string_view kFimSepTexts[] = {"<|file_sep|>"};

TokenType to_token_type(int32_t v) {
  return v >= 1 && v <= 6 ? static_cast<TokenType>(v) : TokenType::Undefined;
}

}  // namespace

void VocabTokenizer::check_id(int32_t id) const {
  if (id < 0 || id >= n_vocab()) {
    throw Error("token id " + std::to_string(id) + " is out of range [0, " + std::to_string(n_vocab()) + ")");
  }
}

void VocabTokenizer::load_common(const GgufFile& file, const Defaults& defaults) {
  file_name_ = file.name();
  const std::vector<std::string_view>& words = file.get_string_array("tokenizer.ggml.tokens");
  const size_t n = words.size();
  if (n == 0) throw Error(file_name_ + ": tokenizer.ggml.tokens is empty");
  if (n >= static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw Error(file_name_ + ": tokenizer.ggml.tokens has too many entries");
  }
  tokens_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    // An empty token could never be matched; llama.cpp renames it the same way.
    if (words[i].empty()) {
      tokens_[i] = "[EMPTY_" + std::to_string(i) + "]";
    } else {
      tokens_[i].assign(words[i]);
    }
  }

  types_.assign(n, TokenType::Normal);
  if (file.has("tokenizer.ggml.token_type")) {
    const std::vector<int32_t> raw = file.get_i32_array("tokenizer.ggml.token_type");
    if (raw.size() < n) {
      throw Error(file_name_ + ": tokenizer.ggml.token_type has " + std::to_string(raw.size()) +
                  " entries for " + std::to_string(n) + " tokens");
    }
    for (size_t i = 0; i < n; ++i) types_[i] = to_token_type(raw[i]);
  }

  tok::index_build(index_slots_, n, [this](size_t i) -> std::string_view { return tokens_[i]; });

  // Special ids: the file's value when in range, else the tokenizer kind's default when in range.
  auto special_id = [&](const char* key, int32_t fallback) -> int32_t {
    const int32_t def = fallback >= 0 && fallback < n_vocab() ? fallback : -1;
    const std::optional<int64_t> v = file.get_int_opt(key);
    if (!v) return def;
    return *v >= 0 && *v < n_vocab() ? static_cast<int32_t>(*v) : def;
  };
  bos_id_ = special_id("tokenizer.ggml.bos_token_id", defaults.bos);
  eos_id_ = special_id("tokenizer.ggml.eos_token_id", defaults.eos);
  unk_id_ = special_id("tokenizer.ggml.unknown_token_id", defaults.unk);
  const int32_t eot_id = special_id("tokenizer.ggml.eot_token_id", -1);
  const int32_t eom_id = special_id("tokenizer.ggml.eom_token_id", -1);
  if (file.has("tokenizer.ggml.add_bos_token")) {
    add_bos_ = file.get_bool_or("tokenizer.ggml.add_bos_token", false);
    if (add_bos_ && bos_id_ < 0) throw Error(file_name_ + ": add_bos_token is set but there is no BOS token");
  } else {
    add_bos_ = defaults.add_bos && bos_id_ >= 0;
  }

  // End of generation: EOS, EOT/EOM from the file, turn-end tokens by text, FIM markers.
  eog_ids_.clear();
  auto add_eog = [&](int32_t id) {
    if (id >= 0 && !is_end_of_generation(id)) eog_ids_.push_back(id);
  };
  struct FimKind {
    const char* key;
    std::span<const std::string_view> texts;
  };
  const FimKind fim_kinds[] = {{"tokenizer.ggml.fim_pad_token_id", kFimPadTexts},
                               {"tokenizer.ggml.fim_rep_token_id", kFimRepTexts},
                               {"tokenizer.ggml.fim_sep_token_id", kFimSepTexts}};
  for (const FimKind& kind : fim_kinds) {
    if (const int32_t from_file = special_id(kind.key, -1); from_file >= 0) {
      add_eog(from_file);
      continue;
    }
    // Found by its text: the lowest matching id, made a control token.
    int32_t id = -1;
    for (std::string_view t : kind.texts) {
      const int32_t candidate = find_token(t);
      if (candidate >= 0 && (id < 0 || candidate < id)) id = candidate;
    }
    if (id < 0) continue;
    add_eog(id);
    types_[id] = TokenType::Control;
  }
  for (std::string_view t : kEogTexts) {
    const int32_t id = find_token(t);
    if (id < 0) continue;
    add_eog(id);
    types_[id] = TokenType::Control;
  }
  // Vocabularies with these markers use "</s>" as ordinary text (llama.cpp's exception).
  if (const int32_t s_id = find_token("</s>");
      s_id >= 0 && (find_token("<|tool_response>") >= 0 || find_token("<|plamo:eos|>") >= 0)) {
    eog_ids_.erase(std::remove(eog_ids_.begin(), eog_ids_.end(), s_id), eog_ids_.end());
    types_[s_id] = TokenType::Normal;
  }
  // Harmony-style vocabularies end a message with <|end|> without ending generation.
  if (const int32_t end_id = find_token("<|end|>");
      end_id >= 0 && find_token("<|call|>") >= 0 &&
      (find_token("<|return|>") >= 0 || (find_token("<|calls|>") >= 0 && find_token("<|flush|>") >= 0))) {
    eog_ids_.erase(std::remove(eog_ids_.begin(), eog_ids_.end(), end_id), eog_ids_.end());
    types_[end_id] = TokenType::UserDefined;
  }
  add_eog(eos_id_);
  add_eog(eot_id);
  add_eog(eom_id);
  std::sort(eog_ids_.begin(), eog_ids_.end());

  splitter_.build(tokens_, types_);
}

std::vector<int32_t> VocabTokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  return encode_impl(text, add_bos, parse_special, {});
}

std::vector<int32_t> VocabTokenizer::encode_with_literals(std::string_view text, bool add_bos,
                                                          std::span<const TextRange> literal) const {
  return encode_impl(text, add_bos, true, literal);
}

std::vector<int32_t> VocabTokenizer::encode_impl(std::string_view text, bool add_bos, bool parse_special,
                                                 std::span<const TextRange> literal) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos) {
    if (bos_id_ < 0) throw Error(file_name_ + ": the vocabulary has no BOS token");
    out.push_back(bos_id_);
  }
  thread_local std::vector<Fragment> fragments;  // [fragments] special tokens and the text between
  splitter_.split(text, parse_special, fragments);
  if (!literal.empty()) {
    // A control token that overlaps a literal range becomes text again, joined with its neighbours
    // (user-defined tokens stay: they match even without parse_special).
    size_t w = 0, r = 0;  // literal ranges before r end before the current fragment
    for (const Fragment& f : fragments) {
      Fragment g = f;
      if (g.token >= 0 && types_[g.token] != TokenType::UserDefined) {
        while (r < literal.size() && literal[r].offset + literal[r].length <= g.offset) ++r;
        if (r < literal.size() && literal[r].offset < g.offset + g.length) g.token = -1;
      }
      if (g.token < 0 && w > 0 && fragments[w - 1].token < 0)
        fragments[w - 1].length = g.offset + g.length - fragments[w - 1].offset;
      else
        fragments[w++] = g;
    }
    fragments.resize(w);
  }
  bool after_special = true;
  for (const Fragment& f : fragments) {
    if (f.token >= 0) {
      out.push_back(f.token);
      after_special = true;
    } else {
      encode_fragment(text.substr(f.offset, f.length), after_special, out);
      after_special = false;
    }
  }
  trim_scratch(fragments);
  return out;
}

std::string byte_token_bytes(std::string_view text) {
  const std::string digits = text.size() >= 5 ? std::string(text.substr(3, 2)) : std::string();
  return std::string(1, static_cast<char>(std::strtol(digits.c_str(), nullptr, 16)));
}

void split_utf8_symbols(std::string_view text, std::vector<MergeSymbol>& syms) {
  syms.clear();
  const auto n = static_cast<uint32_t>(text.size());
  for (uint32_t off = 0; off < n;) {
    const auto len =
        static_cast<uint32_t>(std::min<size_t>(utf8::lead_length(static_cast<uint8_t>(text[off])), n - off));
    const auto index = static_cast<int32_t>(syms.size());
    syms.push_back(MergeSymbol{index - 1, off + len == n ? -1 : index + 1, off, len});
    off += len;
  }
}

}  // namespace tok
}  // namespace microspec
