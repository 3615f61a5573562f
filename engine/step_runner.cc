// engine/step_runner.cc: the eager runner and the graph checks' default (engine/step_runner.h).
#include "engine/step_runner.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <limits>

namespace vlmgraph {

bool GraphChecksByDefault() {
#ifndef NDEBUG
  return true;
#else
  const char* v = std::getenv("VLMGRAPH_CHECK_GRAPHS");
  return v != nullptr && std::strcmp(v, "1") == 0;
#endif
}

double EagerStepRunner::Capture(const BucketKey&, const RegionFn&) {
  PoisonReturned();  // a capture runs the region too (on a GPU, in the shared pool)
  return 0;
}

RunKind EagerStepRunner::Run(const BucketKey&, const RegionFn& fn, bool,
                             std::vector<at::Tensor>* outputs) {
  PoisonReturned();
  *outputs = fn();
  if (check_output_lifetime_) {
    for (at::Tensor& t : *outputs) {
      if (!t.defined()) continue;
      t = t.clone();
      returned_.push_back(t);
    }
  }
  return RunKind::kEager;
}

void EagerStepRunner::set_check_output_lifetime(bool check) {
  check_output_lifetime_ = check;
  if (!check) returned_.clear();
}

// Note [Output lifetime check]: what a graph's replay would leave in an output kept too long.
void EagerStepRunner::PoisonReturned() {
  for (at::Tensor& t : returned_) {
    if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
      t.fill_(std::numeric_limits<double>::quiet_NaN());
    } else if (t.scalar_type() == at::kLong) {
      t.fill_(std::numeric_limits<int64_t>::min());
    } else if (t.scalar_type() == at::kInt) {
      t.fill_(std::numeric_limits<int32_t>::min());
    } else if (t.scalar_type() != at::kBool) {
      t.fill_(-1);
    }
  }
  returned_.clear();
}

}  // namespace vlmgraph
