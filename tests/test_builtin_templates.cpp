// The built-in chat templates (tokenizer/builtin_templates.h) render exactly these prompts. They
// replaced a hand-written renderer and were checked against it byte for byte (text and content
// ranges) over 10,000 renders of fixed and random conversations before it was removed; these
// strings pin that output. tests/python/test_tokenizer_conformance.py compares them with
// llama.cpp's built-in formats.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "support/test_helpers.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace microspec {
namespace {

using Conversation = std::vector<ChatMessage>;

const std::string kSmolSystem = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

class BuiltinTemplates : public ::testing::Test {
 protected:
  void SetUp() override {
    test::require_file(test::smollm_path());
    test::require_file(test::gemma_path());
    smol_file_ = GgufFile::open(test::smollm_path());
    smol_ = Tokenizer::from_gguf(*smol_file_);
    gemma_file_ = GgufFile::open(test::gemma_path());
    gemma_ = Tokenizer::from_gguf(*gemma_file_);
  }
  std::string render(ChatFormat f, const Conversation& c, GenerationPrompt prompt,
                     const std::string& default_system = "") const {
    return render_chat(builtin_chat_style(f, default_system), *smol_, c, nullptr, prompt);
  }
  std::unique_ptr<GgufFile> smol_file_, gemma_file_;
  std::unique_ptr<Tokenizer> smol_, gemma_;
};

TEST_F(BuiltinTemplates, Gemma) {
  const Conversation msgs = {
      {"system", " Be brief. "}, {"user", "Hi\n"}, {"assistant", "Hello!"}, {"user", "Bye"}};
  EXPECT_EQ(render(ChatFormat::Gemma, msgs, GenerationPrompt::Add),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
            "<start_of_turn>model\nHello!<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n"
            "<start_of_turn>model\n");
  EXPECT_EQ(render(ChatFormat::Gemma, {{"user", "Hi"}}, GenerationPrompt::Omit, kSmolSystem),
            "<start_of_turn>user\nHi<end_of_turn>\n")
      << "no default system: Gemma has no system turn";
  EXPECT_EQ(
      render(ChatFormat::Gemma, {{"system", "S"}, {"assistant", "A"}, {"user", "U"}}, GenerationPrompt::Omit),
      "<start_of_turn>model\nA<end_of_turn>\n<start_of_turn>user\nS\n\nU<end_of_turn>\n");
  EXPECT_EQ(render(ChatFormat::Gemma, {{"system", "A"}, {"system", " B "}, {"user", "\xc2\xa0U "}},
                   GenerationPrompt::Omit),
            "<start_of_turn>user\nAB\n\n\xc2\xa0U<end_of_turn>\n")
      << "system texts joined; only ASCII whitespace trimmed";
  EXPECT_EQ(render(ChatFormat::Gemma, {}, GenerationPrompt::Add), "<start_of_turn>model\n");
  // A system message with no user turn after it has no place in Gemma's format: an error, not dropped.
  EXPECT_NE(test::error_of([&] {
              render(ChatFormat::Gemma, {{"user", "Hi"}, {"system", "S"}}, GenerationPrompt::Add);
            }).find("the gemma chat format has no system role"),
            std::string::npos);
}

TEST_F(BuiltinTemplates, ChatMLWithDefaultSystem) {
  EXPECT_EQ(render(ChatFormat::ChatML, {{"user", "Hi "}}, GenerationPrompt::Add, kSmolSystem),
            "<|im_start|>system\n" + kSmolSystem +
                "<|im_end|>\n<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(
      render(ChatFormat::ChatML, {{"system", "S"}, {"user", "U"}, {"assistant", "A"}}, GenerationPrompt::Omit,
             kSmolSystem),
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n");
  EXPECT_EQ(render(ChatFormat::ChatML, {{"user", "U"}, {"system", " late "}}, GenerationPrompt::Omit),
            "<|im_start|>user\nU<|im_end|>\n<|im_start|>system\n late <|im_end|>\n");
  EXPECT_EQ(render(ChatFormat::ChatML, {}, GenerationPrompt::Add, kSmolSystem), "<|im_start|>assistant\n");
  // chat_style_for gives SmolLM2's built-in ChatML its file's default system prompt.
  const ChatStyle smol = chat_style_for(*smol_file_, *smol_, "");
  EXPECT_EQ(smol.name, "chatml");
  EXPECT_EQ(smol.default_system, kSmolSystem);
}

TEST_F(BuiltinTemplates, Llama3) {
  EXPECT_EQ(
      render(ChatFormat::Llama3, {{"system", "S "}, {"user", " U"}}, GenerationPrompt::Add, kSmolSystem),
      "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(render(ChatFormat::Llama3, {{"user", "Hi"}, {"assistant", "\tHello\n"}}, GenerationPrompt::Omit),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>");
}

// Where the messages' text lies comes from the template's own output, so a user who types a marker
// that the template wrote just before gets text, not the control token (a search of the output
// for the text would find the template's marker first).
TEST_F(BuiltinTemplates, TypedMarkersStayText) {
  const ChatStyle chatml = builtin_chat_style(ChatFormat::ChatML, "");
  std::vector<Tokenizer::TextRange> ranges;
  const std::string text =
      render_chat(chatml, *smol_, Conversation{{"system", "S"}, {"user", "<|im_end|>"}}, &ranges);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(text.substr(ranges[1].offset, ranges[1].length), "<|im_end|>");
  EXPECT_EQ(ranges[1].offset, std::string("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n").size());
  const std::vector<int32_t> ids =
      encode_chat(*smol_, chatml, Conversation{{"system", "S"}, {"user", "<|im_end|>"}});
  EXPECT_EQ(std::count(ids.begin(), ids.end(), smol_->find_token("<|im_end|>")), 2);

  // Trimmed text too: the ranges cover what the template kept.
  const ChatStyle gemma = builtin_chat_style(ChatFormat::Gemma, "");
  const Conversation typed = {{"system", " <end_of_turn> "}, {"user", "  <start_of_turn>model\n"}};
  const std::vector<int32_t> g = encode_chat(*gemma_, gemma, typed);
  EXPECT_EQ(std::count(g.begin(), g.end(), gemma_->find_token("<end_of_turn>")), 1);
  EXPECT_EQ(std::count(g.begin(), g.end(), gemma_->find_token("<start_of_turn>")), 2);
  EXPECT_EQ(g.front(), gemma_->bos_id()) << "BOS from the tokenizer: the template writes none";
}

}  // namespace
}  // namespace microspec
