#pragma once
// Grammar-constrained decoding at the token level: which tokens a grammar (grammar/grammar.h)
// allows after the tokens so far, and the masking of a logits row to those tokens.
//
// A token is allowed when all of its bytes advance the grammar's state; an end-of-generation token
// is allowed exactly when the bytes so far form a complete sentence; tokens without bytes (other
// control tokens) never are. The mask is what makes constrained speculative decoding exact: every
// row the target produces, plain or verified, is masked for the state its own history leaves, so
// choosing from the masked row is choosing from the constrained distribution.
//
// Masking a whole 262,144-token row is a walk over a trie of the vocabulary; it is cached per
// state, since a JSON grammar revisits the same states (inside a string, after a comma ...). Most
// rows need far less: a greedy choice needs only the best allowed token, so mask_row checks the
// row's best tokens one by one and masks those that rank above it (see mask_row).
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "grammar/grammar.h"

namespace microspec {

class Tokenizer;

// The vocabulary as the grammar sees it: every token's bytes, which tokens end a generation, and a
// trie of the bytes for whole-row masks. Made once per tokenizer; immutable.
class GrammarVocabulary {
 public:
  explicit GrammarVocabulary(const Tokenizer& tok);
  // From the tokens' bytes ([n_vocab]; empty: never allowed) and the end-of-generation ids.
  GrammarVocabulary(const std::vector<std::string>& pieces, const std::vector<int32_t>& end_ids);
  int32_t size() const { return static_cast<int32_t>(ends_.size()); }
  // The token's bytes; empty for control and unused tokens.
  std::string_view bytes(int32_t id) const {
    return std::string_view(text_).substr(size_t(offset_[size_t(id)]), size_t(offset_[size_t(id) + 1] - offset_[size_t(id)]));
  }
  bool ends(int32_t id) const { return ends_[size_t(id)] != 0; }

  struct TrieNode {
    uint8_t byte = 0;
    int32_t first_child = -1, next_sibling = -1;
    int32_t tokens_begin = 0, tokens_end = 0;  // tokens whose bytes end here: trie_tokens_[begin, end)
  };
  const std::vector<TrieNode>& trie() const { return trie_; }  // node 0: the root (no byte)
  const std::vector<int32_t>& trie_tokens() const { return trie_tokens_; }

 private:
  std::string text_;              // every token's bytes, concatenated
  std::vector<int64_t> offset_;   // [n_vocab + 1] into text_
  std::vector<uint8_t> ends_;     // [n_vocab] end-of-generation tokens
  std::vector<TrieNode> trie_;    // [nodes]
  std::vector<int32_t> trie_tokens_;  // [tokens with bytes], grouped by trie node
};

// One grammar over one vocabulary, shared by every sequence that decodes with it (the server's
// requests with the same response_format share nothing else). Thread-safe.
class TokenConstraint {
 public:
  TokenConstraint(Grammar grammar, std::shared_ptr<const GrammarVocabulary> vocab);

  const Grammar& grammar() const { return grammar_; }
  const GrammarVocabulary& vocab() const { return *vocab_; }
  // Whether `token` may follow in `state`.
  bool allows(const GrammarState& state, int32_t token, GrammarScratch& scratch) const;
  // `state` advanced by the token's bytes; false (and `state` dead) if the token is not allowed.
  // An end-of-generation token leaves a complete state as it is.
  bool advance(GrammarState& state, int32_t token, GrammarScratch& scratch) const;
  // Every token allowed in `state`, as a bit per token ([n_vocab / 64 words]), cached by state.
  std::shared_ptr<const std::vector<uint64_t>> full_mask(const GrammarState& state, GrammarScratch& scratch) const;

 private:
  struct StateHash {
    size_t operator()(const std::vector<int32_t>& v) const;
  };
  // The trie walk behind full_mask: sets the bit of every token whose bytes `state` accepts.
  void walk(const GrammarState& state, std::vector<uint64_t>& bits, GrammarScratch& scratch) const;

  Grammar grammar_;
  std::shared_ptr<const GrammarVocabulary> vocab_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::vector<int32_t>, std::shared_ptr<const std::vector<uint64_t>>, StateHash> masks_;
};

// One sequence's constraint: the grammar state after the tokens it generated, and the row masking
// every decoding path applies (sampling/penalties.h runs it after the penalties).
class GrammarMatcher {
 public:
  // keep_best: how many of a row's best allowed tokens mask_row must leave a row with, every token
  // ranked above them masked (1 for greedy choice; the sampler's top-k; 0: mask every disallowed
  // token, for top-k off or log-probabilities, which need the whole masked row).
  GrammarMatcher(std::shared_ptr<const TokenConstraint> constraint, int32_t keep_best);
  // Starts a sequence: nothing generated yet.
  void begin();
  // A generated token joins the history. Throws Error if the grammar does not allow it.
  void accept(int32_t token);
  // Masks a row of n_vocab logits for the state after the history and then `path` (tokens after
  // the history, oldest first): disallowed tokens become -inf, either all of them or (keep_best >
  // 0) those ranked above the keep_best-th allowed one, ranks by logit then lower id. A path the
  // grammar refuses leaves the row unmasked (no decoding path reads such a row). Throws Error when
  // the grammar allows no token the row can give.
  void mask_row(float* logits, std::span<const int32_t> path = {});
  // Whether every token of `path` is allowed in turn after the history.
  bool allows_path(std::span<const int32_t> path);

 private:
  void state_after(std::span<const int32_t> path, GrammarState& out);
  void mask_all(float* logits, const GrammarState& state);
  // The partial mask; false when the best tokens held too few allowed ones (mask_all then).
  bool mask_ranked(float* logits, const GrammarState& state);

  std::shared_ptr<const TokenConstraint> constraint_;
  int32_t keep_best_;
  int32_t n_vocab_;
  GrammarState start_, state_;  // before anything was generated; after the history
  GrammarState path_state_;     // mask_row's state after a path
  GrammarScratch scratch_;
  std::vector<std::pair<float, int32_t>> ranked_;  // [candidates] mask_ranked's best tokens
  std::vector<int32_t> refused_;                   // [candidates] those the grammar refuses
};

}  // namespace microspec
