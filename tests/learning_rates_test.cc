// LearningRates (engine/learning_rates.h): upstream nanoVLM's defaults, the one range check and
// its messages, the group table.
#include "engine/learning_rates.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "engine/engine_types.h"

namespace vlmgraph {
namespace {

// Upstream nanoVLM's TrainConfig (models/config.py at 4e0c096):
//   lr_mp: float = 0.00512
//   lr_vision_backbone: float = 5e-5
//   lr_language_backbone: float = 5e-5
TEST(LearningRates, DefaultsAreUpstreamNanoVlms) {
  const LearningRates r;
  EXPECT_EQ(r.projector, 0.00512);
  EXPECT_EQ(r.vision, 5e-5);
  EXPECT_EQ(r.language, 5e-5);
  EXPECT_FALSE(r.Check().has_value());
}

TEST(LearningRates, GroupsAreNamedAsTheTrainersGroups) {
  LearningRates r{/*projector=*/1, /*vision=*/2, /*language=*/3};
  EXPECT_EQ(*r.Find("projector"), 1);
  EXPECT_EQ(*r.Find("vision"), 2);
  EXPECT_EQ(*r.Find("language"), 3);
  EXPECT_EQ(r.Find("lr"), nullptr);
  *r.Find("vision") = 0;
  EXPECT_EQ(r.vision, 0);
  ASSERT_EQ(LearningRates::kGroups.size(), 3u);
  for (const auto& g : LearningRates::kGroups) EXPECT_EQ(r.Find(g.name), &(r.*g.rate));
  EXPECT_EQ(LearningRates::All(0.25), (LearningRates{0.25, 0.25, 0.25}));
}

// The APIs' range is [0, 1] each (0 freezes a part): the message names the field, the range and
// the value, and says what to set; the bounds pass.
TEST(LearningRates, CheckNamesTheFieldAndSaysWhatToChange) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    double LearningRates::*rate;
    double value;
    const char* field;
    const char* text;
  };
  const Case cases[] = {
      {&LearningRates::language, 1e30, "language_learning_rate", "must lie in [0, 1], got 1e+30"},
      {&LearningRates::vision, -1e-3, "vision_learning_rate", "must lie in [0, 1], got -0.001"},
      {&LearningRates::projector, nan, "projector_learning_rate", "must lie in [0, 1], got nan"},
      {&LearningRates::language, inf, "language_learning_rate", "must lie in [0, 1], got inf"},
  };
  for (const Case& c : cases) {
    LearningRates r;
    r.*c.rate = c.value;
    const auto problem = r.Check();
    ASSERT_TRUE(problem.has_value()) << c.field << " " << c.value;
    EXPECT_EQ(problem->field, c.field);
    EXPECT_EQ(problem->message.rfind(c.text, 0), 0u) << problem->message;
    EXPECT_NE(problem->message.find("0 freezes"), std::string::npos) << problem->message;
    try {
      r.Validate();
      ADD_FAILURE() << c.field << " " << c.value << " validated";
    } catch (const EngineError& e) {
      EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
      EXPECT_EQ(e.field(), c.field);
      EXPECT_EQ(std::string(e.what()), std::string(c.field) + ": " + problem->message);
    }
  }
  LearningRates vision;
  vision.vision = 2;
  EXPECT_NE(vision.Check()->message.find("upstream nanoVLM's default is 5e-05"), std::string::npos);
  LearningRates projector;
  projector.projector = -1;
  EXPECT_NE(projector.Check()->message.find("0 freezes the modality projector"), std::string::npos);
  EXPECT_FALSE(LearningRates::All(0).Check().has_value());
  EXPECT_FALSE(LearningRates::All(1).Check().has_value());
  EXPECT_FALSE(LearningRates::All(0).AnyTrained());
  EXPECT_TRUE((LearningRates{0, 1e-9, 0}).AnyTrained());
}

// Without an upper bound (the Trainer's own check) any finite rate >= 0 passes.
TEST(LearningRates, UnboundedCheckRefusesOnlyNegativeAndNonFiniteRates) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(LearningRates::All(1e30).Check(inf).has_value());
  for (double bad : {-1e-12, inf, std::numeric_limits<double>::quiet_NaN()}) {
    LearningRates r;
    r.language = bad;
    const auto problem = r.Check(inf);
    ASSERT_TRUE(problem.has_value()) << bad;
    EXPECT_EQ(problem->field, "language_learning_rate");
    EXPECT_EQ(problem->message.rfind("must be finite and >= 0, got", 0), 0u) << problem->message;
  }
}

}  // namespace
}  // namespace vlmgraph
