// How front ends write a conversation (tokenizer/chat.h: ChatStyle): a Jinja template through the
// interpreter (chat_template/), built-in or not. SmolLM2's own template gives the same prompt ids
// as the built-in ChatML template for every conversation; a Gemma-style template written
// here gives the built-in Gemma format's ids (the template writing BOS itself, never twice); what
// a user typed stays text wherever the template put it verbatim, and a template that changed such
// text is refused rather than turning it into control tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "support/test_helpers.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace microspec {
namespace {

using Conversation = std::vector<ChatMessage>;

std::vector<Conversation> conversations() {
  return {
      {{"user", "Name a color."}},
      {{"system", "Be brief."}, {"user", "Name a color."}},
      {{"user", "Hi"}, {"assistant", "Hello! How can I help?"}, {"user", "Tell me a joke."}},
      {{"user", "  spaces around  "}},
      {{"user", "Type <|im_end|> and <end_of_turn> and <bos> as text."}},
      // The same text as the marker the template wrote just before it: still text.
      {{"system", "Be brief."}, {"user", "<|im_end|>"}},
  };
}

std::string write_template(const std::string& name, const std::string& text) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

TEST(ChatStyle, SmolLM2sOwnTemplateGivesTheBuiltInChatMLIds) {
  test::require_file(test::smollm_path());
  auto file = GgufFile::open(test::smollm_path());
  auto tok = Tokenizer::from_gguf(*file);
  const ChatStyle builtin = chat_style_for(*file, *tok, "");
  const ChatStyle own = chat_style_for(*file, *tok, "model");
  EXPECT_EQ(builtin.name, "chatml");
  EXPECT_EQ(own.name, "the model's template");
  for (const Conversation& c : conversations()) {
    const std::vector<int32_t> ids = encode_chat(*tok, own, c);
    EXPECT_EQ(ids, encode_chat(*tok, builtin, c)) << c.back().content;
    // A user's "<|im_end|>" is text: the end-of-turn token appears only where the template put it.
    EXPECT_EQ(std::count(ids.begin(), ids.end(), tok->find_token("<|im_end|>")), int64_t(c.size()) + 1 -
                                                                                        (c[0].role == "system"))
        << c.back().content;
  }
}

TEST(ChatStyle, AGemmaStyleTemplateGivesTheBuiltInGemmaIds) {
  test::require_file(test::gemma_path());
  auto file = GgufFile::open(test::gemma_path());
  auto tok = Tokenizer::from_gguf(*file);
  const ChatStyle builtin = chat_style_for(*file, *tok, "");
  EXPECT_EQ(builtin.name, "gemma");
  // The shipped Gemma is the base model: it carries no template of its own.
  EXPECT_NE(test::error_of([&] { chat_style_for(*file, *tok, "model"); }).find("no chat template"),
            std::string::npos);
  const std::string path = write_template(
      "microspec_gemma_style.jinja",
      "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
      "{{ m.content | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
      "{% endif %}");
  const ChatStyle jinja = chat_style_for(*file, *tok, path);
  EXPECT_EQ(jinja.name, path);
  for (const Conversation& c : conversations()) {
    if (c[0].role == "system") continue;  // the built-in format folds it into the user turn; this template does not
    const std::vector<int32_t> ids = encode_chat(*tok, jinja, c);
    EXPECT_EQ(ids, encode_chat(*tok, builtin, c)) << c.back().content;
    EXPECT_EQ(std::count(ids.begin(), ids.end(), tok->bos_id()), 1) << "BOS written by the template only";
  }
}

TEST(ChatStyle, ATemplateThatChangesControlTextIsRefused) {
  test::require_file(test::smollm_path());
  auto file = GgufFile::open(test::smollm_path());
  auto tok = Tokenizer::from_gguf(*file);
  const ChatStyle upper = chat_style_for(
      *file, *tok,
      write_template("microspec_upper.jinja",
                     "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n"));
  // Changed text without control-token strings is fine (encoded as the template wrote it)...
  const std::vector<int32_t> ids = encode_chat(*tok, upper, Conversation{{"user", "hello"}});
  EXPECT_EQ(tok->decode(ids, /*special=*/true).find("HELLO"), std::string("<|im_start|>user\n").size());
  // ...but changed text holding one would become a control token: refused.
  EXPECT_NE(test::error_of([&] { encode_chat(*tok, upper, Conversation{{"user", "a <|im_end|> b"}}); })
                .find("control-token text"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { chat_style_for(*file, *tok, "/nonexistent/template.jinja"); })
                .find("cannot open"),
            std::string::npos);
  EXPECT_EQ(chat_style_for(*file, *tok, "llama3").name, "llama3");
  EXPECT_NE(test::error_of([&] {
              chat_style_for(*file, *tok, write_template("microspec_bad.jinja", "{% for m in messages %}"));
            }).find("for"),
            std::string::npos)
      << "a syntax error names the construct";
}

}  // namespace
}  // namespace microspec
