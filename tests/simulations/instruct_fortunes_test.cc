// The instruct-fortunes study (simulations/instruct_fortunes.h) on three
// synthetic topics: its tokenizer shares the base's byte ids, and LoRA
// instruction tuning, federated or alone, lowers every site's held-out
// response loss below the pretrained base's.
#include "simulations/instruct_fortunes.h"

#include <gtest/gtest.h>

#include "models/text_corpus.h"
#include "models/tokenizer.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/text_topics.h"

namespace estuary::simulations {
namespace {

TEST(AsciiTokenizer, AsciiIsItsBytesAndTheSpecialTokensSitOnControlIds) {
  testing::TempDir dir;
  ASSERT_TRUE(WriteAsciiTokenizer(dir / "tok").ok());
  auto tokenizer = models::Tokenizer::Load(dir / "tok" / "tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  std::string ascii;
  for (int c = ' '; c <= '~'; ++c) ascii += char(c);
  ascii += "\n\t  two spaces";
  EXPECT_EQ(tokenizer->Encode(ascii, false), models::ByteTokenizer::Encode(ascii));
  EXPECT_EQ(tokenizer->Encode("<|im_start|>user\n<|im_end|></s>", false),
            (std::vector<int32_t>{3, 'u', 's', 'e', 'r', '\n', 4, 2}));
  EXPECT_EQ(tokenizer->Encode("caf\xc3\xa9", false), (std::vector<int32_t>{'c', 'a', 'f', 0}));  // é: <unk>
  EXPECT_EQ(tokenizer->Decode(models::ByteTokenizer::Encode("fish and chips\n"), false), "fish and chips\n");
}

TEST(InstructFortunes, EverySiteLearnsTheInstructionFederatedAndAlone) {
  testing::TempDir dir;
  InstructFortunesOptions o;
  o.data_dir = WriteTopics(dir);
  o.topics = "cats,numbers";  // "plays" pretrains the base
  o.seq_len = 64;
  o.batch = 4;
  o.pretrain_steps = 20;
  o.rounds = 2;
  o.local_steps = 4;
  o.rank = 4;
  o.alpha = 8;
  o.eval_windows = 8;
  o.workdir = dir / "study";
  auto report = RunInstructFortunes(o, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_GT(report->pretrain_tokens, 0u);
  ASSERT_EQ(report->round_loss.size(), 2u);
  ASSERT_EQ(report->sites.size(), 2u);
  for (const auto& site : report->sites) {
    EXPECT_GT(site.train_examples, 80u) << site.topic;  // about nine tenths of 120
    EXPECT_GT(site.held_out_examples, 0u) << site.topic;
    EXPECT_GT(site.held_out_targets, site.held_out_examples) << site.topic;
    EXPECT_LT(site.federated_loss, site.base_loss) << site.topic;
    EXPECT_LT(site.local_loss, site.base_loss) << site.topic;
    EXPECT_TRUE(std::filesystem::exists(o.workdir / ("held-out-" + site.topic + ".jsonl"))) << site.topic;
  }
  const std::string table = RenderInstructFortunes(*report);
  EXPECT_NE(table.find("| cats | "), std::string::npos) << table;
  EXPECT_NE(table.find("all (per scored token)"), std::string::npos) << table;
  EXPECT_EQ(ToJson(*report)["scenario"], "instruct-fortunes");

  // From the saved base: no pretraining and the same figures, bit for bit.
  InstructFortunesOptions again = o;
  again.base_model = o.workdir / "base.safetensors";
  again.workdir = dir / "again";
  auto second = RunInstructFortunes(again, nullptr);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->pretrain_tokens, 0u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(second->sites[i].base_loss, report->sites[i].base_loss);
    EXPECT_EQ(second->sites[i].federated_loss, report->sites[i].federated_loss);
    EXPECT_EQ(second->sites[i].local_loss, report->sites[i].local_loss);
  }

  // A topic that is not there is named, as are two that repeat.
  o.topics = "cats,poetry";
  EXPECT_NE(RunInstructFortunes(o, nullptr).status().message().find("'poetry'"), std::string::npos);
  o.topics = "cats,cats";
  EXPECT_EQ(RunInstructFortunes(o, nullptr).status().message(),
            "instruct-fortunes: --topics 'cats,cats' must name distinct topics");
}

}  // namespace
}  // namespace estuary::simulations
