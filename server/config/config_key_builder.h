// server/config/config_key_builder.h: internal to server/config: how config_schema.cc's key
// table is written. Key("section.leaf", &ServerConfig::section, &Section::leaf) starts a
// KeyBuilder, whose .Doc/.Default/.Range/.OneOf/... calls say what the key means, and .Build()
// makes the ConfigKey (server/config/config_schema.h) with its parse, default, validation and
// print functions; the messages name the key's path and what to change. Thread rules: none
// (pure functions of their arguments).
#pragma once

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "server/config/config.h"
#include "server/config/config_schema.h"
#include "server/config/listen_address.h"

namespace vlmgraph::server::config_detail {

using IntList = std::vector<int64_t>;

// "must be 'a' or 'b', got 'x'" for two values, "must be one of a, b, c; got 'x'" for more.
inline std::string OneOfMessage(const std::vector<std::string>& allowed, const std::string& got) {
  if (allowed.size() == 2) {
    return "must be '" + allowed[0] + "' or '" + allowed[1] + "', got '" + got + "'";
  }
  std::string names;
  for (const std::string& a : allowed) names += (names.empty() ? "" : ", ") + a;
  return "must be one of " + names + "; got '" + got + "'";
}

inline std::string RangeMessage(const std::optional<double>& min, const std::optional<double>& max,
                         const std::string& got) {
  if (min && max)
    return "must lie in [" + ConfigNumber(*min) + ", " + ConfigNumber(*max) + "], got " + got;
  if (min) return "must be >= " + ConfigNumber(*min) + ", got " + got;
  return "must be <= " + ConfigNumber(*max) + ", got " + got;
}

template <typename N>
bool InRange(N v, const std::optional<double>& min, const std::optional<double>& max) {
  if constexpr (std::is_floating_point_v<N>) {
    if (std::isnan(v)) return !min && !max;
    return (!min || v >= *min) && (!max || v <= *max);
  } else {  // integer bounds compare exactly in the key's own type
    return (!min || v >= static_cast<N>(*min)) && (!max || v <= static_cast<N>(*max));
  }
}

template <typename N>
std::string NumberText(N v) {
  if constexpr (std::is_floating_point_v<N>) {
    return ConfigNumber(v);
  } else {
    return std::to_string(v);
  }
}

template <typename T>
T ScalarAs(const YAML::Node& n, const std::string& path, const char* type_name) {
  if (!n.IsScalar())
    throw ServerConfigError(path, std::string("must be ") + type_name + YamlLine(n));
  try {
    return n.as<T>();
  } catch (const YAML::BadConversion&) {
    throw ServerConfigError(
        path, std::string("must be ") + type_name + ", got '" + n.Scalar() + "'" + YamlLine(n));
  }
}

inline IntList ParseIntList(const YAML::Node& n, const std::string& path) {
  if (!n.IsSequence()) {
    throw ServerConfigError(path, "must be a list of integers, like [1, 2, 4]" + YamlLine(n));
  }
  IntList out;
  for (size_t i = 0; i < n.size(); ++i) {
    out.push_back(ScalarAs<int64_t>(n[i], path + "[" + std::to_string(i) + "]", "an integer"));
  }
  return out;
}

// A listen address: a string in one of ListenAddress's forms, "" for none. An unquoted IPv6 form
// reads as a YAML list ([::1]:8000), so that mistake gets its own message.
inline ListenAddress ParseAddress(const YAML::Node& n, const std::string& path) {
  if (!n.IsScalar()) {
    throw ServerConfigError(path,
                            "must be a string HOST:PORT or [IPV6]:PORT; quote an IPv6 one "
                            "in YAML: \"[::1]:8000\"" +
                                YamlLine(n));
  }
  if (n.Scalar().empty()) return ListenAddress();
  try {
    return ListenAddress::Parse(n.Scalar());
  } catch (const std::invalid_argument& e) {
    throw ServerConfigError(path, e.what() + YamlLine(n));
  }
}

// A default computed from keys earlier in the table, and how, in words.
template <typename T>
struct Derivation {
  std::string how;
  std::function<T(const ServerConfig&)> value;
};

// Builds one ConfigKey for a ServerConfig field of type T; the typed operations come from T.
template <typename T>
class KeyBuilder {
 public:
  KeyBuilder(std::string name, std::function<T&(ServerConfig&)> field,
             std::function<const T&(const ServerConfig&)> read)
      : name_(std::move(name)), field_(std::move(field)), read_(std::move(read)) {}

  KeyBuilder& Doc(std::string doc) {
    doc_ = std::move(doc);
    return *this;
  }
  KeyBuilder& Default(T value) {
    default_ = std::move(value);
    has_default_ = true;
    return *this;
  }
  KeyBuilder& Derived(Derivation<T> derivation) {
    derived_ = std::move(derivation);
    return *this;
  }
  KeyBuilder& Range(double min, double max) {
    min_ = min;
    max_ = max;
    return *this;
  }
  KeyBuilder& AtLeast(double min) {
    min_ = min;
    return *this;
  }
  KeyBuilder& NonEmpty() {
    non_empty_ = true;
    return *this;
  }
  KeyBuilder& Secret() {
    secret_ = true;
    return *this;
  }
  // A string key limited to `values`.
  KeyBuilder& OneOf(const std::vector<std::string>& values) {
    static_assert(std::is_same_v<T, std::string>, "OneOf is for string keys; enums use Names");
    for (const std::string& v : values) names_.emplace_back(v, v);
    return *this;
  }
  // An enum key: each value's YAML name, in documentation order.
  KeyBuilder& Names(std::vector<std::pair<std::string, T>> names) {
    names_ = std::move(names);
    return *this;
  }

  operator ConfigKey() const {  // NOLINT(google-explicit-constructor): the table's element type
    if (!has_default_ && !derived_.value)
      throw std::logic_error("config key " + name_ + ": no default");
    ConfigKey k;
    k.name = name_;
    k.type = Type();
    k.doc = doc_;
    k.derived_default = static_cast<bool>(derived_.value);
    k.default_text = k.derived_default ? derived_.how : Text(default_);
    k.min = min_;
    k.max = max_;
    k.non_empty = non_empty_;
    for (const auto& entry : names_) k.allowed.push_back(entry.first);
    k.secret = secret_;
    k.parse = [b = *this](const YAML::Node& n, ServerConfig& c) { b.field_(c) = b.Parse(n); };
    k.set_default = [b = *this](ServerConfig& c) {
      b.field_(c) = b.derived_.value ? b.derived_.value(c) : b.default_;
    };
    k.check_range = [b = *this](const ServerConfig& c) { b.Check(b.read_(c)); };
    k.emit = [b = *this](const ServerConfig& c, YAML::Emitter& out) { b.Emit(b.read_(c), out); };
    return k;
  }

 private:
  ConfigType Type() const {
    if (!names_.empty()) return ConfigType::kEnum;
    if constexpr (std::is_same_v<T, bool>) return ConfigType::kBool;
    if constexpr (std::is_same_v<T, int64_t>) return ConfigType::kInteger;
    if constexpr (std::is_same_v<T, uint64_t>) return ConfigType::kUnsigned;
    if constexpr (std::is_same_v<T, double>) return ConfigType::kSeconds;
    if constexpr (std::is_same_v<T, IntList>) return ConfigType::kIntegerList;
    if constexpr (std::is_same_v<T, ListenAddress>) return ConfigType::kAddress;
    return ConfigType::kString;
  }

  T Parse(const YAML::Node& n) const {
    if constexpr (std::is_same_v<T, IntList>) {
      return ParseIntList(n, name_);
    } else if constexpr (std::is_same_v<T, bool>) {
      return ScalarAs<bool>(n, name_, "true or false");
    } else if constexpr (std::is_same_v<T, int64_t>) {
      return ScalarAs<int64_t>(n, name_, "an integer");
    } else if constexpr (std::is_same_v<T, uint64_t>) {
      const int64_t v = ScalarAs<int64_t>(n, name_, "an integer");
      if (v < 0)
        throw ServerConfigError(name_, "must be >= 0, got " + std::to_string(v) + YamlLine(n));
      return static_cast<uint64_t>(v);
    } else if constexpr (std::is_same_v<T, ListenAddress>) {
      return ParseAddress(n, name_);
    } else if constexpr (std::is_same_v<T, double>) {
      const bool seconds = name_.size() > 8 && name_.compare(name_.size() - 8, 8, "_seconds") == 0;
      return ScalarAs<double>(n, name_, seconds ? "a number of seconds" : "a number");
    } else {  // a string, or an enum by name
      const std::string s = ScalarAs<std::string>(n, name_, "a string");
      if constexpr (std::is_same_v<T, std::string>) {
        if (names_.empty()) return s;
      }
      for (const auto& [name, value] : names_) {
        if (name == s) return value;
      }
      throw ServerConfigError(name_, OneOfMessage(AllowedNames(), s) + YamlLine(n));
    }
  }

  void Check(const T& v) const {
    if constexpr (std::is_same_v<T, IntList>) {
      if (non_empty_ && v.empty()) throw ServerConfigError(name_, "must not be empty");
      for (size_t i = 0; i < v.size(); ++i) {
        if (!InRange(v[i], min_, max_)) {
          throw ServerConfigError(name_ + "[" + std::to_string(i) + "]",
                                  RangeMessage(min_, max_, std::to_string(v[i])));
        }
      }
    } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      if (!InRange(v, min_, max_))
        throw ServerConfigError(name_, RangeMessage(min_, max_, NumberText(v)));
    } else if constexpr (std::is_same_v<T, ListenAddress>) {
      if (non_empty_ && v.empty())
        throw ServerConfigError(name_, "must not be empty: write HOST:PORT or [IPV6]:PORT");
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (non_empty_ && v.empty()) throw ServerConfigError(name_, "must not be empty");
      const auto allowed = AllowedNames();
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), v) == allowed.end())
        throw ServerConfigError(name_, OneOfMessage(allowed, v));
    }
    // bool and enum fields hold only valid values.
  }

  void Emit(const T& v, YAML::Emitter& out) const {
    if constexpr (std::is_same_v<T, IntList>) {
      out << YAML::Flow << v;
    } else if constexpr (std::is_enum_v<T>) {
      for (const auto& [name, value] : names_) {
        if (value == v) {
          out << name;
          return;
        }
      }
      throw std::logic_error("config key " + name_ + ": a value without a name");
    } else if constexpr (std::is_same_v<T, std::string>) {
      out << (secret_ && !v.empty() ? std::string("<set>") : v);
    } else if constexpr (std::is_same_v<T, ListenAddress>) {
      out << v.ToString();
    } else if constexpr (std::is_same_v<T, double>) {
      out << YAML::DoublePrecision(15) << v;  // 0.9, not 0.90000000000000002
    } else {
      out << v;
    }
  }

  std::string Text(const T& v) const {
    YAML::Emitter out;
    Emit(v, out);
    return out.c_str();
  }

  std::vector<std::string> AllowedNames() const {
    std::vector<std::string> names;
    for (const auto& entry : names_) names.push_back(entry.first);
    return names;
  }

  std::string name_;
  std::function<T&(ServerConfig&)> field_;
  std::function<const T&(const ServerConfig&)> read_;
  std::string doc_;
  T default_{};
  bool has_default_ = false;
  Derivation<T> derived_;
  std::optional<double> min_, max_;
  bool non_empty_ = false;
  bool secret_ = false;
  std::vector<std::pair<std::string, T>> names_;
};

// A top-level key: Key("model", &ServerConfig::model).
template <typename T>
KeyBuilder<T> Key(std::string name, T ServerConfig::*field) {
  return KeyBuilder<T>(
      std::move(name), [field](ServerConfig& c) -> T& { return c.*field; },
      [field](const ServerConfig& c) -> const T& { return c.*field; });
}

// A key of a section: Key("capture.lazy", &ServerConfig::capture, &ServerConfig::Capture::lazy).
template <typename S, typename T>
KeyBuilder<T> Key(std::string name, S ServerConfig::*section, T S::*field) {
  return KeyBuilder<T>(
      std::move(name), [section, field](ServerConfig& c) -> T& { return c.*section.*field; },
      [section, field](const ServerConfig& c) -> const T& { return c.*section.*field; });
}

}  // namespace vlmgraph::server::config_detail
