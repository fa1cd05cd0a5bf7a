#pragma once
// Tokenizers built from GGUF metadata: SentencePiece-style ("llama": Gemma) and byte-level BPE
// ("gpt2": SmolLM2, Llama 3, Qwen2). Results match llama.cpp's tokenizer on the same file.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace microspec {

class GgufFile;

enum class TokenType : int32_t { Undefined = 0, Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };

class Tokenizer {
 public:
  // Throws Error naming the file when the metadata is missing or inconsistent.
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& file);
  virtual ~Tokenizer() = default;

  // Encodes text. Invalid UTF-8 never crashes: bad bytes are encoded as byte tokens / replaced as
  // llama.cpp does. add_bos: prepend BOS (use add_bos_default() for the file's rule).
  // parse_special: text matching control/special token strings becomes those tokens.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const = 0;
  // Encodes with special tokens parsed, except inside the `literal` byte ranges of text (sorted,
  // not overlapping): there control-token strings are plain text, as with parse_special false.
  // Chat prompts: the template's own markers are control tokens, what a user typed is text.
  struct TextRange {
    size_t offset, length;
  };
  virtual std::vector<int32_t> encode_with_literals(std::string_view text, bool add_bos,
                                                    std::span<const TextRange> literal) const = 0;

  // The bytes one token stands for when printed (may be a partial UTF-8 sequence; control
  // tokens give their text only when `special` is true).
  virtual std::string token_to_piece(int32_t id, bool special = false) const = 0;
  std::string decode(std::span<const int32_t> ids, bool special = false) const;

  int32_t n_vocab() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool add_bos_default() const { return add_bos_; }
  // True for EOS and the end-of-turn tokens (<end_of_turn>, <|im_end|>, <|eot_id|>, <|endoftext|>, eot_token_id).
  // The set is llama.cpp's: its list of turn-end texts and the fill-in-the-middle markers included.
  bool is_end_of_generation(int32_t id) const;
  const std::vector<int32_t>& end_of_generation_ids() const { return eog_ids_; }
  // Looks up a token by its exact vocabulary string; -1 if absent.
  int32_t find_token(std::string_view text) const;
  const std::string& token_text(int32_t id) const { return tokens_.at(id); }
  TokenType token_type(int32_t id) const { return types_.at(id); }

 protected:
  std::vector<std::string> tokens_;  // [n_vocab] vocabulary strings as stored in the file
  std::vector<TokenType> types_;     // [n_vocab]
  int32_t bos_id_ = -1, eos_id_ = -1;
  bool add_bos_ = false;
  std::vector<int32_t> eog_ids_;
  // find_token's open-addressing index over tokens_: [capacity, a power of two] slots, each
  // (32-bit hash << 32) | (token id + 1), 0 for an empty slot.
  std::vector<uint64_t> index_slots_;
};

// Buffers decoded bytes and releases only complete UTF-8 sequences, for streaming output.
class Utf8StreamDecoder {
 public:
  std::string push(std::string_view bytes);  // returns the complete part, keeps a partial tail
  std::string flush();                       // whatever is left (invalid tail bytes become U+FFFD)

 private:
  std::string pending_;
};

}  // namespace microspec
