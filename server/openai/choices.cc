#include "server/openai/choices.h"

#include <utility>

namespace vlmgraph::server::openai {

ResponseChoices::ResponseChoices(bool chat, ResponseMeta meta,
                                 const std::vector<PreparedGeneration>* prompts,
                                 const Tokenizer* tokenizer)
    : chat_(chat), meta_(std::move(meta)), prompts_(prompts) {
  for (size_t p = 0; p < prompts->size(); ++p) {
    const PreparedGeneration& g = (*prompts)[p];
    for (int64_t k = 0; k < g.n; ++k) {
      choices_.push_back({p, false, false, "", "", 0, ChatLogprobs(tokenizer),
                          CompletionLogprobs(tokenizer, g.top_logprobs)});
    }
  }
}

bool ResponseChoices::stream() const { return !prompts_->empty() && prompts_->front().stream; }

std::string ResponseChoices::StreamStart() {
  if (!stream() || !chat_) return "";
  std::string events;
  const bool usage = prompts_->front().include_usage;
  for (size_t i = 0; i < choices_.size(); ++i) {
    events += SseEvent(ChatCompletionChunkJson(meta_, static_cast<int64_t>(i),
                                               {{"role", "assistant"}, {"content", ""}}, nullptr,
                                               "", usage));
  }
  return events;
}

json ResponseChoices::LogprobsJson(Choice& c) {
  if (!(*prompts_)[c.prompt].logprobs) return nullptr;
  return chat_ ? c.chat_logprobs.Take() : c.completion_logprobs.Take();
}

std::string ResponseChoices::Chunk(size_t i, const std::string& text) {
  Choice& c = choices_[i];
  const bool usage = (*prompts_)[c.prompt].include_usage;
  const int64_t index = static_cast<int64_t>(i);
  return SseEvent(
      chat_ ? ChatCompletionChunkJson(meta_, index, {{"content", text}}, LogprobsJson(c), "", usage)
            : CompletionChunkJson(meta_, index, text, LogprobsJson(c), "", usage));
}

std::string ResponseChoices::OnDelta(size_t i, const GenerationDelta& delta) {
  Choice& c = choices_[i];
  const PreparedGeneration& g = (*prompts_)[c.prompt];
  std::string events;
  if (!c.started) {
    c.started = true;
    if (g.echo) {
      const std::vector<int64_t>& ids = g.request.input_ids;
      if (g.logprobs && delta.prompt_logprobs && !ids.empty()) {
        c.completion_logprobs.AddUnscored(ids[0]);
        const std::vector<TokenLogprob>& prompt = *delta.prompt_logprobs;
        for (size_t j = 1; j < ids.size() && j - 1 < prompt.size(); ++j)
          c.completion_logprobs.Add(ids[j], prompt[j - 1]);
      }
      if (g.stream) {
        events += Chunk(i, g.echo_text);
      } else {
        c.text += g.echo_text;
      }
    }
  }
  if (g.echo_only) return events;  // the one token the engine made is left out
  c.completion_tokens += static_cast<int64_t>(delta.token_ids.size());
  if (g.logprobs) {
    for (size_t j = 0; j < delta.token_ids.size() && j < delta.logprobs.size(); ++j) {
      if (chat_) {
        c.chat_logprobs.Add(delta.token_ids[j], delta.logprobs[j]);
      } else {
        c.completion_logprobs.Add(delta.token_ids[j], delta.logprobs[j]);
      }
    }
  }
  if (!g.stream) {
    c.text += delta.text;
    return events;
  }
  if (!delta.text.empty() || (g.logprobs && !delta.token_ids.empty()))
    events += Chunk(i, delta.text);
  return events;
}

std::string ResponseChoices::OnFinish(size_t i, const GenerationOutcome& outcome) {
  Choice& c = choices_[i];
  const PreparedGeneration& g = (*prompts_)[c.prompt];
  c.finished = true;
  c.finish_reason = g.echo_only ? "length" : FinishReasonString(outcome.reason);
  c.completion_tokens = g.echo_only ? 0 : outcome.generated_tokens;
  if (!g.stream) return "";
  const int64_t index = static_cast<int64_t>(i);
  return SseEvent(
      chat_ ? ChatCompletionChunkJson(meta_, index, json::object(), nullptr, c.finish_reason,
                                      g.include_usage)
            : CompletionChunkJson(meta_, index, "", nullptr, c.finish_reason, g.include_usage));
}

bool ResponseChoices::all_finished() const {
  for (const Choice& c : choices_) {
    if (!c.finished) return false;
  }
  return true;
}

Usage ResponseChoices::TotalUsage() const {
  Usage usage;
  for (const PreparedGeneration& g : *prompts_) usage.prompt_tokens += g.prompt_tokens;
  for (const Choice& c : choices_) usage.completion_tokens += c.completion_tokens;
  return usage;
}

std::string ResponseChoices::StreamEnd() const {
  std::string events;
  if (!prompts_->empty() && prompts_->front().include_usage) {
    events += SseEvent(
        UsageChunkJson(meta_, chat_ ? "chat.completion.chunk" : "text_completion", TotalUsage()));
  }
  return events + kSseDone;
}

json ResponseChoices::TakeBody() {
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    Choice& c = choices_[i];
    const int64_t index = static_cast<int64_t>(i);
    json logprobs = LogprobsJson(c);
    choices.push_back(chat_ ? ChatChoiceJson(index, c.text, logprobs, c.finish_reason)
                            : CompletionChoiceJson(index, c.text, logprobs, c.finish_reason));
  }
  return chat_ ? ChatCompletionJson(meta_, std::move(choices), TotalUsage())
               : CompletionJson(meta_, std::move(choices), TotalUsage());
}

}  // namespace vlmgraph::server::openai
