#include "model/weight_init.h"

namespace vlmgraph {
namespace {
thread_local bool skip_weight_init = false;
}  // namespace

SkipWeightInit::SkipWeightInit() : previous_(skip_weight_init) { skip_weight_init = true; }
SkipWeightInit::~SkipWeightInit() { skip_weight_init = previous_; }
bool WeightInitSkipped() { return skip_weight_init; }

}  // namespace vlmgraph
