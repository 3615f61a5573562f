// model/weight_init.h: the switch for nanoVLM's weight initialisation.
//
// The model's dense layers (model/layers.h) draw their weights from N(0, 0.02), as upstream's
// _init_weights does. Callers that overwrite every parameter right after construction (LoadModel,
// which fails unless the checkpoint has every tensor, and the trainer's working copy) skip that
// draw: on a CPU it costs about 4 ns per parameter, ~2 s for nanovlm-460m. The few other
// parameters (the patch convolution, the position embedding, norms) keep their initialisation.
//
//   { vlmgraph::SkipWeightInit skip; model = vlmgraph::VisionLanguageModel(cfg); }
//
// Thread rules: the switch is per thread; guards nest.
#pragma once

namespace vlmgraph {

class SkipWeightInit {
 public:
  SkipWeightInit();
  ~SkipWeightInit();
  SkipWeightInit(const SkipWeightInit&) = delete;
  SkipWeightInit& operator=(const SkipWeightInit&) = delete;

 private:
  bool previous_;
};

// True while a SkipWeightInit lives on this thread.
bool WeightInitSkipped();

}  // namespace vlmgraph
