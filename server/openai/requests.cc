#include "server/openai/requests.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "image/image_processor.h"
#include "server/core/image_workers.h"
#include "server/core/text_stream.h"
#include "text/tokenizer.h"

namespace vlmgraph::server::openai {
namespace {

// --- JSON fields
// ----------------------------------------------------------------------------------

json ParseBody(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    std::string what = e.what();
    if (const size_t p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    throw BadRequest("malformed JSON in the request body: " + what);
  }
  if (!j.is_object()) {
    throw BadRequest(std::string("the request body must be a JSON object, got ") + j.type_name());
  }
  return j;
}

// The field `key` of `obj`, or nullptr when it is missing or null (OpenAI treats both as unset).
const json* Field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

ApiError WrongType(const std::string& param, const char* expected, const json& got) {
  return BadRequest(param + ": must be " + expected + ", got " + got.type_name(), param);
}

std::optional<std::string> OptString(const json& obj, const char* key, const std::string& param) {
  const json* f = Field(obj, key);
  if (!f) return std::nullopt;
  if (!f->is_string()) throw WrongType(param, "a string", *f);
  return f->get<std::string>();
}

std::optional<bool> OptBool(const json& obj, const char* key, const std::string& param) {
  const json* f = Field(obj, key);
  if (!f) return std::nullopt;
  if (!f->is_boolean()) throw WrongType(param, "true or false", *f);
  return f->get<bool>();
}

std::optional<double> OptNumber(const json& obj, const char* key, const std::string& param) {
  const json* f = Field(obj, key);
  if (!f) return std::nullopt;
  if (!f->is_number()) throw WrongType(param, "a number", *f);
  return f->get<double>();
}

int64_t ToInt(const json& v, const std::string& param) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})
      throw BadRequest(param + ": too large", param);
    return v.get<int64_t>();
  }
  // 5.0 is accepted as 5, as pydantic (vLLM) does.
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e18)
      return static_cast<int64_t>(d);
  }
  throw WrongType(param, "an integer", v);
}

std::optional<int64_t> OptInt(const json& obj, const char* key, const std::string& param) {
  const json* f = Field(obj, key);
  if (!f) return std::nullopt;
  return ToInt(*f, param);
}

// Integers only: whether they are token ids of the vocabulary is for Engine::Validate (prompt,
// stop_token_ids) or the tokenizer (/detokenize) to say.
std::vector<int64_t> IntList(const json& v, const std::string& param) {
  if (!v.is_array()) throw WrongType(param, "a list of integers", v);
  std::vector<int64_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out.push_back(ToInt(v[i], param + "[" + std::to_string(i) + "]"));
  return out;
}



// --- request parts
// --------------------------------------------------------------------------------

void CheckModel(const json& body, const RequestContext& ctx) {
  const std::optional<std::string> model = OptString(body, "model", "model");
  if (!model || *model == ctx.served_model_name) return;
  ErrorInfo e;
  e.http_status = 404;
  e.type = "invalid_request_error";
  e.message = "The model `" + *model + "` does not exist. This server serves `" +
              ctx.served_model_name + "` (GET /v1/models lists it).";
  e.param = "model";
  e.code = "model_not_found";
  throw ApiError(std::move(e));
}

// Features this server does not have: refused, since ignoring them would return something else
// than what the client asked for.
void RefuseUnsupported(const json& body, bool chat) {
  auto refuse = [](const std::string& param, const std::string& what) {
    throw BadRequest(param + ": " + what + " is not supported by this server", param);
  };
  if (chat) {
    for (const char* key : {"tools", "functions"}) {
      const json* f = Field(body, key);
      if (f && !(f->is_array() && f->empty())) refuse(key, "tool calling");
    }
    if (const json* f = Field(body, "response_format")) {
      if (!f->is_object() || f->value("type", std::string()) != "text")
        refuse("response_format", "a response_format other than {\"type\": \"text\"}");
    }
  } else {
    if (OptString(body, "suffix", "suffix").value_or("") != "") refuse("suffix", "suffix");
    if (OptInt(body, "best_of", "best_of").value_or(1) != 1) refuse("best_of", "best_of > 1");
  }
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (OptNumber(body, key, key).value_or(0.0) != 0.0) refuse(key, "a non-zero penalty");
  }
  if (const json* f = Field(body, "logit_bias"); f && !(f->is_object() && f->empty()))
    refuse("logit_bias", "logit_bias");
}

// A count of alternatives per position, in [0, kMaxTopLogprobs].
int64_t TopLogprobs(int64_t v, const std::string& param) {
  if (v < 0 || v > kMaxTopLogprobs) {
    throw BadRequest(param + ": must lie in [0, " + std::to_string(kMaxTopLogprobs) + "], got " +
                         std::to_string(v),
                     param);
  }
  return v;
}

// Chat: logprobs (bool) and top_logprobs (int, needs logprobs: true), as OpenAI; completions:
// logprobs (int) and echo.
void ParseLogprobs(const json& body, bool chat, GenerationParams* p) {
  if (chat) {
    p->logprobs = OptBool(body, "logprobs", "logprobs").value_or(false);
    if (const std::optional<int64_t> top = OptInt(body, "top_logprobs", "top_logprobs")) {
      p->top_logprobs = TopLogprobs(*top, "top_logprobs");
      p->logprobs_param = "top_logprobs";
      if (!p->logprobs && *top > 0) {
        throw BadRequest("top_logprobs: needs logprobs: true; send \"logprobs\": true with it",
                         "top_logprobs");
      }
    }
    return;
  }
  if (const std::optional<int64_t> top = OptInt(body, "logprobs", "logprobs")) {
    p->logprobs = true;
    p->top_logprobs = TopLogprobs(*top, "logprobs");
  }
  p->echo = OptBool(body, "echo", "echo").value_or(false);
}

// Types and this API's own rules only; the values the engine checks (max_tokens >= 1 and within
// limits.max_new_tokens, top_p, top_k, stop_token_ids, the context) are refused by
// Engine::Validate and named in this API's terms by FromEngineError.
GenerationParams ParseGenerationParams(const json& body, bool chat) {
  RefuseUnsupported(body, chat);
  GenerationParams p;
  if (const std::optional<int64_t> n = OptInt(body, "n", "n")) {
    if (*n < 1 || *n > kMaxChoices) {
      throw BadRequest(
          "n: must lie in [1, " + std::to_string(kMaxChoices) + "], got " + std::to_string(*n),
          "n");
    }
    p.n = *n;
  }
  ParseLogprobs(body, chat, &p);
  // max_completion_tokens replaces the deprecated max_tokens (OpenAI); vLLM takes it first too.
  for (const char* key : {"max_completion_tokens", "max_tokens"}) {
    const std::optional<int64_t> v = OptInt(body, key, key);
    if (!v) continue;
    p.max_tokens = *v;
    p.max_tokens_param = key;
    break;
  }
  // OpenAI's temperature, [0, 2] with 0 = greedy, is this API's own domain: it decides between
  // greedy and sampling before the engine sees a temperature (which must then be > 0).
  if (const auto t = OptNumber(body, "temperature", "temperature")) {
    if (!(*t >= 0 && *t <= 2))
      throw BadRequest("temperature: must lie in [0, 2] (0 = greedy)", "temperature");
    p.temperature = *t;
  }
  if (const auto t = OptNumber(body, "top_p", "top_p")) p.top_p = *t;
  if (const auto k = OptInt(body, "top_k", "top_k")) p.top_k = *k == -1 ? 0 : *k;  // vLLM's off
  if (const auto s = OptInt(body, "seed", "seed")) p.seed = static_cast<uint64_t>(*s);
  if (const json* stop = Field(body, "stop")) {
    std::vector<std::string> strings;
    if (stop->is_string()) {
      strings.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > 4)
        throw BadRequest("stop: at most 4 stop strings, got " + std::to_string(stop->size()),
                         "stop");
      for (const json& s : *stop) {
        if (!s.is_string()) throw WrongType("stop", "a string or a list of strings", *stop);
        strings.push_back(s.get<std::string>());
      }
    } else {
      throw WrongType("stop", "a string or a list of strings", *stop);
    }
    // OpenAI's limit of 4, and the gRPC API's length bound (kMaxStopStringBytes); an empty
    // string stops nothing and is dropped.
    for (size_t i = 0; i < strings.size(); ++i) {
      if (strings[i].size() > kMaxStopStringBytes) {
        const std::string field = stop->is_array() ? "stop[" + std::to_string(i) + "]" : "stop";
        throw BadRequest(field + ": " + std::to_string(strings[i].size()) +
                             " bytes; a stop string may have at most " +
                             std::to_string(kMaxStopStringBytes),
                         "stop");
      }
      if (!strings[i].empty()) p.stop.push_back(std::move(strings[i]));
    }
  }
  if (const json* ids = Field(body, "stop_token_ids"))
    p.stop_token_ids = IntList(*ids, "stop_token_ids");
  p.ignore_eos = OptBool(body, "ignore_eos", "ignore_eos").value_or(false);
  p.stream = OptBool(body, "stream", "stream").value_or(false);
  if (const json* so = Field(body, "stream_options")) {
    if (!p.stream)
      throw BadRequest("stream_options: only allowed when stream is true", "stream_options");
    if (!so->is_object()) throw WrongType("stream_options", "an object", *so);
    p.include_usage = OptBool(*so, "include_usage", "stream_options.include_usage").value_or(false);
  }
  return p;
}

ChatInput ParseMessages(const json& body, const Limits& limits) {
  const json* messages = Field(body, "messages");
  if (!messages) {
    throw BadRequest(
        "messages: required; send a list of messages such as "
        "[{\"role\": \"user\", \"content\": \"Hello\"}]",
        "messages");
  }
  if (!messages->is_array()) throw WrongType("messages", "a list of messages", *messages);
  if (messages->empty()) throw BadRequest("messages: must not be empty", "messages");
  ChatInput out;
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string path = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw WrongType(path, "an object with role and content", m);
    std::optional<std::string> role = OptString(m, "role", path + ".role");
    if (!role) throw BadRequest(path + ".role: required", path + ".role");
    if (*role == "developer") role = "system";  // OpenAI's newer name for the system role
    if (*role != "system" && *role != "user" && *role != "assistant") {
      throw BadRequest(path + ".role: '" + *role +
                           "' is not supported; use system, developer, user or assistant",
                       path + ".role");
    }
    ChatMessage message{*role, {}};
    const json* content = Field(m, "content");
    if (!content) {
      if (*role != "assistant") throw BadRequest(path + ".content: required", path + ".content");
    } else if (content->is_string()) {
      message.content.push_back(ChatContentPart::Text(content->get<std::string>()));
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        const std::string ppath = path + ".content[" + std::to_string(k) + "]";
        if (!part.is_object()) throw WrongType(ppath, "a content part object", part);
        const std::optional<std::string> type = OptString(part, "type", ppath + ".type");
        if (type == "text") {
          const std::optional<std::string> text = OptString(part, "text", ppath + ".text");
          if (!text) throw BadRequest(ppath + ".text: required", ppath + ".text");
          message.content.push_back(ChatContentPart::Text(*text));
        } else if (type == "image_url") {
          // {"image_url": {"url": ...}} as OpenAI; a bare string is accepted too (as vLLM).
          const json* image = Field(part, "image_url");
          std::string url_path = ppath + ".image_url";
          std::optional<std::string> url;
          if (image && image->is_string()) {
            url = image->get<std::string>();
          } else if (image && image->is_object()) {
            url_path += ".url";
            url = OptString(*image, "url", url_path);
          }
          if (!url) {
            throw BadRequest(
                ppath + ".image_url: required, as {\"url\": \"data:image/png;base64,...\"}",
                ppath + ".image_url");
          }
          if (static_cast<int64_t>(out.images.size()) >= limits.max_images_per_request) {
            throw BadRequest("messages: more than " +
                                 std::to_string(limits.max_images_per_request) +
                                 " images; at most that many are allowed per request "
                                 "(limits.max_images_per_request)",
                             "messages");
          }
          out.images.push_back({DecodeImageUrl(*url, limits, url_path), url_path});
          message.content.push_back(ChatContentPart::Image());
        } else {
          throw BadRequest(
              ppath + ".type: '" + type.value_or("") + "' is not supported; use text or image_url",
              ppath + ".type");
        }
      }
    } else {
      throw WrongType(path + ".content", "a string or a list of content parts", *content);
    }
    out.messages.push_back(std::move(message));
  }
  return out;
}

// --- prompts
// --------------------------------------------------------------------------------------

uint64_t RandomSeed() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

// The images' sizes from their headers, then their tiles: a request whose images make more tiles
// than the engine takes (MaxTilesPerImage, its max_tiles_per_request) is refused before any image
// is decoded.
void CheckImageHeaders(const std::vector<EncodedImage>& images, const VlmConfig& cfg,
                       const ImageLimits& image_limits) {
  std::vector<int64_t> tiles;
  for (const EncodedImage& image : images) {
    try {
      const ImageSize size = ReadImageSize(image.bytes, image_limits);
      CheckResizeFits(size.height, size.width, cfg, image_limits);
      tiles.push_back(ImageTileCount(size.height, size.width, cfg));
    } catch (const ImageError& e) {
      throw BadRequest(image.param + ": " + e.what(), image.param);
    }
  }
  try {
    CheckTileCount(tiles, MaxTilesPerImage(cfg), cfg);
  } catch (const ImageError& e) {
    throw BadRequest(std::string("messages: ") + e.what(), "messages");
  }
}

std::vector<ImageTiles> PreprocessImages(const std::vector<EncodedImage>& images,
                                         const VlmConfig& cfg, const Limits& limits) {
  const ImageLimits image_limits{limits.max_image_bytes, limits.max_image_pixels};
  CheckImageHeaders(images, cfg, image_limits);
  std::vector<ImageTiles> out;
  for (const EncodedImage& image : images) {
    try {
      // On the image workers: ATen's intra-op threads stay bounded (server/core/image_workers.h).
      out.push_back(
          RunImageWork([&] { return PreprocessEncodedImage(image.bytes, cfg, image_limits); }));
    } catch (const ImageError& e) {
      throw BadRequest(image.param + ": " + e.what(), image.param);
    }
  }
  return out;
}

ApiError ContextLengthExceeded(const std::string& message, const std::string& param) {
  return BadRequest(message, param, "context_length_exceeded");
}

// PromptTooLong (known from the text's bytes, before tokenizing) in OpenAI's and vLLM's wording.
ApiError ContextLengthExceeded(const PromptTooLong& e) {
  return ContextLengthExceeded(
      "This model's maximum context length is " + std::to_string(e.max_context()) +
          " tokens. However, your " + e.field() + " resulted in at least " +
          std::to_string(e.min_tokens()) + " tokens (" + std::to_string(e.text_bytes()) +
          " bytes of text; no token stands for more than " +
          std::to_string(e.max_bytes_per_token()) + " bytes). Please reduce the length of the " +
          e.field() + ".",
      e.field());
}

// Runs `build` (which tokenizes), answering PromptTooLong with context_length_exceeded.
template <typename Build>
auto Tokenizing(Build&& build) -> decltype(build()) {
  try {
    return build();
  } catch (const PromptTooLong& e) {
    throw ContextLengthExceeded(e);
  }
}

// max_tokens, else limits.default_max_new_tokens capped to the context left (vLLM's default).
// Not checked here: Engine::Validate refuses a prompt that leaves no room, and a max_tokens < 1,
// above limits.max_new_tokens or past the context.
int64_t MaxNewTokens(const GenerationParams& p, int64_t prompt_tokens, const Limits& limits,
                     int64_t max_context) {
  if (p.max_tokens) return *p.max_tokens;
  return std::min(limits.default_max_new_tokens, max_context - prompt_tokens);
}

PreparedGeneration Finish(const GenerationParams& p, std::vector<int64_t> input_ids,
                          at::Tensor tiles, const TextModel& text, const Limits& limits,
                          int64_t max_context, const std::string& what) {
  PreparedGeneration g;
  g.prompt_tokens = static_cast<int64_t>(input_ids.size());
  SamplingParams& s = g.request.sampling;
  s.max_new_tokens = MaxNewTokens(p, g.prompt_tokens, limits, max_context);
  // OpenAI's echo with max_tokens 0: the prompt alone. The engine makes one token, left out.
  g.echo_only = p.echo && p.max_tokens && *p.max_tokens == 0;
  if (g.echo_only) s.max_new_tokens = 1;
  s.greedy = p.temperature < kGreedyTemperature;
  s.temperature = s.greedy ? 1.0 : p.temperature;
  s.top_p = p.top_p;
  s.top_k = p.top_k;
  s.seed = p.seed ? *p.seed : RandomSeed();
  if (!p.ignore_eos) s.stop_token_ids = text.default_stop_token_ids();
  for (int64_t id : p.stop_token_ids) {
    if (std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), id) == s.stop_token_ids.end())
      s.stop_token_ids.push_back(id);
  }
  g.request.input_ids = std::move(input_ids);
  g.request.tiles = std::move(tiles);
  g.stop_strings = p.stop;
  g.prompt_param = what;
  g.max_tokens_param = p.max_tokens_param;
  g.stream = p.stream;
  g.include_usage = p.include_usage;
  g.n = p.n;
  g.logprobs = p.logprobs;
  g.top_logprobs = p.top_logprobs;
  g.logprobs_param = p.logprobs_param;
  g.echo = p.echo;
  LogprobsParams& l = g.request.logprobs;
  l.tokens = p.logprobs;
  l.top = p.top_logprobs;
  l.prompt = p.logprobs && p.echo;
  l.prompt_top = l.prompt ? p.top_logprobs : 0;
  return g;
}

}  // namespace

// --- requests
// -------------------------------------------------------------------------------------

ChatCompletionRequest ParseChatCompletionRequest(const std::string& body,
                                                 const RequestContext& ctx) {
  const json j = ParseBody(body);
  CheckModel(j, ctx);
  ChatCompletionRequest r;
  r.params = ParseGenerationParams(j, /*chat=*/true);
  r.chat = ParseMessages(j, ctx.limits);
  return r;
}

CompletionRequest ParseCompletionRequest(const std::string& body, const RequestContext& ctx) {
  const json j = ParseBody(body);
  CheckModel(j, ctx);
  CompletionRequest r;
  r.params = ParseGenerationParams(j, /*chat=*/false);
  const json* prompt = Field(j, "prompt");
  if (!prompt) throw BadRequest("prompt: required; send the text to complete", "prompt");
  // OpenAI's forms: "text", [ids...], or a batch: ["text", ...] or [[ids...], ...].
  auto is_number = [](const json& v) { return v.is_number(); };
  auto one = [&](const json& v, const std::string& param) {
    CompletionPrompt p;
    if (v.is_string()) {
      p.text = v.get<std::string>();
      if (p.text->empty()) throw BadRequest(param + ": must not be empty", param);
    } else if (v.is_array() && !v.empty() && std::all_of(v.begin(), v.end(), is_number)) {
      p.ids = IntList(v, param);
    } else {
      throw BadRequest(param + ": must be a non-empty string or a non-empty list of token ids",
                       param);
    }
    return p;
  };
  if (prompt->is_array() && !prompt->empty() &&
      !std::all_of(prompt->begin(), prompt->end(), is_number)) {
    const bool strings = (*prompt)[0].is_string();
    for (size_t i = 0; i < prompt->size(); ++i) {
      const std::string param = "prompt[" + std::to_string(i) + "]";
      if ((*prompt)[i].is_string() != strings) {
        throw BadRequest(param +
                             ": a batch of prompts must be all strings or all lists of "
                             "token ids",
                         param);
      }
      r.prompts.push_back(one((*prompt)[i], param));
    }
  } else {
    r.prompts.push_back(one(*prompt, "prompt"));
  }
  const int64_t choices = static_cast<int64_t>(r.prompts.size()) * r.params.n;
  if (choices > kMaxChoices) {
    throw BadRequest("prompt: " + std::to_string(r.prompts.size()) + " prompts x n = " +
                         std::to_string(r.params.n) + " make " + std::to_string(choices) +
                         " choices; at most " + std::to_string(kMaxChoices) +
                         " are allowed per request: send fewer prompts per request",
                     "prompt");
  }
  return r;
}

TokenizeRequest ParseTokenizeRequest(const std::string& body, const RequestContext& ctx) {
  const json j = ParseBody(body);
  CheckModel(j, ctx);
  TokenizeRequest r;
  if (Field(j, "messages")) {
    r.chat = ParseMessages(j, ctx.limits);
    r.add_generation_prompt =
        OptBool(j, "add_generation_prompt", "add_generation_prompt").value_or(true);
    return r;
  }
  r.prompt = OptString(j, "prompt", "prompt");
  if (!r.prompt) throw BadRequest("prompt or messages: one of them is required", "prompt");
  r.add_special_tokens = OptBool(j, "add_special_tokens", "add_special_tokens").value_or(true);
  return r;
}

DetokenizeRequest ParseDetokenizeRequest(const std::string& body, const RequestContext& ctx) {
  const json j = ParseBody(body);
  CheckModel(j, ctx);
  const json* tokens = Field(j, "tokens");
  if (!tokens) throw BadRequest("tokens: required; send a list of token ids", "tokens");
  return {IntList(*tokens, "tokens")};
}

// --- engine requests
// ------------------------------------------------------------------------------

// Limits before work: the text's length (no tokenizing), then the images' headers (no decoding),
// then the work. Note [Tokens from bytes] in text/tokenizer.cc.
PreparedGeneration PrepareChatCompletion(const ChatCompletionRequest& request,
                                         const TextModel& text, const VlmConfig& cfg,
                                         const Limits& limits, int64_t max_context) {
  Prompt prompt = Tokenizing([&] {
    text.CheckTextLength(ContentTexts(request.chat.messages), "messages");
    const std::vector<ImageTiles> images = PreprocessImages(request.chat.images, cfg, limits);
    return text.BuildChat(request.chat.messages, images, /*add_generation_prompt=*/true);
  });
  return Finish(request.params, std::move(prompt.input_ids), std::move(prompt.tiles), text, limits,
                max_context, "messages");
}

PreparedGeneration PrepareCompletion(const CompletionRequest& request, const TextModel& text,
                                     const Limits& limits, int64_t max_context, size_t prompt) {
  const CompletionPrompt& p = request.prompts.at(prompt);
  std::vector<int64_t> ids = p.ids;
  if (p.text) ids = Tokenizing([&] { return text.BuildText(*p.text, {}).input_ids; });
  PreparedGeneration g =
      Finish(request.params, std::move(ids), at::Tensor(), text, limits, max_context, "prompt");
  if (g.echo) {
    if (p.text) {
      g.echo_text = *p.text;
    } else {
      try {  // as vLLM: the ids decoded, special tokens kept
        g.echo_text = text.tokenizer().Decode(p.ids, /*skip_special_tokens=*/false);
      } catch (const TokenizerError& e) {
        throw BadRequest(std::string("prompt: ") + e.what(), "prompt");
      }
    }
  }
  return g;
}

GenerateRequest ChoiceRequest(const PreparedGeneration& g, int64_t choice) {
  GenerateRequest r = g.request;  // tiles are shared, not copied
  r.sampling.seed += static_cast<uint64_t>(choice);
  return r;
}

// vLLM's /tokenize has no limit; this one refuses, with the same context_length_exceeded, a text
// that cannot fit the longest context (a prompt that no endpoint would take), so that its work is
// bounded like every other endpoint's. A prompt is tokenized like /v1/completions' (special
// tokens recognised), messages like /v1/chat/completions' (content special-token text is plain
// text unless parse_special_in_content).
std::vector<int64_t> TokenizeIds(const TokenizeRequest& request, const TextModel& text,
                                 const VlmConfig& cfg, const Limits& limits) {
  return Tokenizing([&] {
    if (request.prompt) {
      text.CheckTextLength({*request.prompt}, "prompt");
      try {
        return text.tokenizer().Encode(*request.prompt, request.add_special_tokens);
      } catch (const TokenizerError& e) {
        throw BadRequest(std::string("prompt: ") + e.what(), "prompt");
      }
    }
    text.CheckTextLength(ContentTexts(request.chat.messages), "messages");
    const std::vector<ImageTiles> images = PreprocessImages(request.chat.images, cfg, limits);
    return text.BuildChat(request.chat.messages, images, request.add_generation_prompt).input_ids;
  });
}

std::string DetokenizeText(const DetokenizeRequest& request, const TextModel& text) {
  try {
    return text.tokenizer().Decode(request.tokens, /*skip_special_tokens=*/false);
  } catch (const TokenizerError& e) {
    throw BadRequest(std::string("tokens: ") + e.what(), "tokens");
  }
}

// The translation table: Engine::Validate's field names (EngineError::field, the gRPC API's
// paths) -> this API's request fields, and the words for them where the engine's differ.
ApiError FromEngineError(const EngineError& e, const PreparedGeneration& g) {
  if (e.code() != EngineError::Code::kInvalidArgument)
    return ApiError(ErrorFromException(std::make_exception_ptr(e)));
  const std::string& what = g.prompt_param;
  if (const std::optional<ContextOverflow>& o = e.context_overflow()) {
    // OpenAI's and vLLM's wording.
    const std::string head =
        "This model's maximum context length is " + std::to_string(o->max_context) + " tokens. ";
    if (o->max_new_tokens == 0) {
      return ContextLengthExceeded(head + "However, your " + what + " resulted in " +
                                       std::to_string(o->prompt_tokens) +
                                       " tokens. Please reduce the length of the " + what + ".",
                                   what);
    }
    return ContextLengthExceeded(
        head + "However, you requested " + std::to_string(o->prompt_tokens + o->max_new_tokens) +
            " tokens (" + std::to_string(o->prompt_tokens) + " in the " + what + ", " +
            std::to_string(o->max_new_tokens) + " in the completion). Please reduce the length " +
            "of the " + what + " or completion.",
        what);
  }
  const std::string message = e.what();
  const std::string& field = e.field();
  // The prompt the server built (token positions of the tokenized prompt, image tiles): the
  // message keeps the engine's words; param names the request field it came from.
  if (field == "input_ids" || field == "tiles") return BadRequest(message, what);
  struct Name {
    const char* engine;
    std::string api;
    const char* problem;  // this API's words for what is wrong; nullptr = the engine's
  };
  const Name names[] = {
      {"sampling.max_new_tokens", g.max_tokens_param, nullptr},
      {"sampling.temperature", "temperature", nullptr},
      {"sampling.top_p", "top_p", nullptr},
      {"sampling.top_k", "top_k", ": must be >= 1, or 0 or -1 to disable it"},
      {"sampling.stop_token_ids", "stop_token_ids", nullptr},
      {"logprobs.top", g.logprobs_param, nullptr},
      {"logprobs.prompt_top", g.logprobs_param, nullptr},
  };
  for (const Name& n : names) {
    if (field != n.engine) continue;
    // what() is "<field>: <problem>" (EngineError); the problem after the engine's name.
    const std::string problem = n.problem ? std::string(n.problem)
                                : message.compare(0, field.size(), field) == 0
                                    ? message.substr(field.size())
                                    : ": " + message;
    return BadRequest(n.api + problem, n.api);
  }
  return BadRequest(message);
}

}  // namespace vlmgraph::server::openai
