"""Text for the tokenizer parity test and benchmark (tests/tokenizer/): lines of files that Debian
packages install, picked deterministically, and a hand-made set of corner cases.

debian_lines(): the lines (without their "\n") of, in this order and each list sorted by path,
/usr/share/common-licenses/*, /usr/share/doc/*/copyright, the gzip'd roff sources under
/usr/share/man/man1 and the headers under /usr/include; files that are not UTF-8 are skipped; each
source contributes at most its quota of lines. debian_documents(): the first 4 KiB of some of
those files, whole (newlines inside). corner_cases(): scripts, emoji, whitespace, contractions,
digits, special tokens, plus seeded random mixes of all of them.
"""
import glob
import gzip
import os
import random

# (glob, quota of lines, gzip'd)
SOURCES = [
    ("/usr/share/common-licenses/*", 6000, False),
    ("/usr/share/doc/*/copyright", 6000, False),
    ("/usr/share/man/man1/*.1.gz", 4000, True),
    ("/usr/include/*.h", 4000, False),
]


def _read_text(path, gzipped):
    try:
        if not os.path.isfile(path):
            return None
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as fh:
            data = fh.read(4 << 20)
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None


def _files():
    for pattern, quota, gzipped in SOURCES:
        yield pattern, quota, gzipped, sorted(p for p in glob.glob(pattern) if os.path.isfile(p))


def debian_lines():
    """Lines of Debian text files, by source; returns (lines, {source glob: line count})."""
    lines, counts = [], {}
    for pattern, quota, gzipped, paths in _files():
        taken = 0
        for path in paths:
            if taken >= quota:
                break
            text = _read_text(path, gzipped)
            if text is None:
                continue
            for line in text.split("\n")[: quota - taken]:
                lines.append(line)
                taken += 1
        counts[pattern] = taken
    return lines, counts


def debian_documents(per_source=40):
    """The first 4 KiB (cut at a line end) of the first `per_source` readable files of each source."""
    docs = []
    for pattern, _, gzipped, paths in _files():
        taken = 0
        for path in paths:
            if taken >= per_source:
                break
            text = _read_text(path, gzipped)
            if not text:
                continue
            cut = text[:4096]
            if len(text) > 4096 and "\n" in cut:
                cut = cut[: cut.rindex("\n") + 1]
            docs.append(cut)
            taken += 1
    return docs


SPECIAL_CASES = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|image|><row_1_col_1>",
    "<row_8_col_8><row_1_col_1><|global_image|><|image|>",
    "<|im_sta", "<|im_start|", "<|im_start", "im_start|>", "<<|im_end|>>", "<|<|im_end|>|>",
    "<|endoftext|><|endoftext|>", "text<|image|>text", " <|im_start|> spaced ", "\n<|im_end|>\n",
    "<row_1_col_9>", "<row_1_col_1", "<|image|>x<|global_image|>\n\n<row_2_col_3> end",
    "<mask>", "a <mask> b", "  <mask>  ", "a<mask>b", "\t<mask>\n<mask>", "<mask><mask>",
    "zzword", "a zzword b", "azzword", "zzwordb", "zzword, zzword.", "é zzword", "zzwordé",
    "ǅx", "Džx y", "ǅx   z", "ǅxǅx",
]

CORNER_CASES = [
    "", " ", "  ", "\t", "\n", "\r", "\r\n", "\n\n\n", "   \n  ", " " * 17, " " * 1000,
    "\t" * 9, "\n" * 50, "a  b", "a   b", "a\tb\t\tc", "x" + " " * 40 + "y", "\r\n\r\n",
    "hello\r\nworld\r\n", "line one\nline two\n", "trailing spaces   ", "   leading spaces",
    " \t \n \r\n \t", "\u00a0\u2003\u3000 mixed spaces\u2009here", "\x0b\x0c\x85\u2028\u2029",
    "word\u00a0word", "tab\there", "ends with newline\n", "\n starts with newline",
    "I'm", "you're", "they've", "he'll", "she'd", "it's", "don't", "I'M", "YOU'RE", "IT'S",
    "DON'T", "THEY'VE", "HE'LL", "SHE'D", "'s", "'S", "''s", "x's's", "'Re", "'rE", "rock'n'roll",
    "'", "''", "'''", " 's", "It's John's 'quote'", "l'été", "’s curly", "O'Neill's",
    "1234567890", "3.14159", "in 2024 there were 1,234,567 users", "00000000000000000000000000000",
    "١٢٣٤ Arabic-Indic digits", "①②③ Ⅻ ½", "x²³", "v1.2.3-rc4", "0x7fffffff", "1e-10", "-42",
    "123abc456", "९८७ Devanagari digits", "١٢٣abc٤٥٦",
    "你好，世界！这是一个测试。", "日本語のテキストです。カタカナ、ひらがな。", "한국어 텍스트입니다.",
    "漢字かな交じり文", "中文 English 混合 text", "。，！？",
    "مرحبا بالعالم، هذا اختبار.", "שלום עולם", "ال 123 عربي",
    "नमस्ते दुनिया, यह एक परीक्षण है।", "हिन्दी क्षत्रिय", "สวัสดีชาวโลก", "ทดสอบภาษาไทย",
    "Привет, мир! Ёжик.", "Γειά σου Κόσμε", "Ελληνικά ΚΕΦΑΛΑΙΑ", "Ünïcödé Çà Œuvre ß ẞ",
    "👍", "👨‍👩‍👧‍👦 family", "🏳️‍🌈", "👋🏽 wave", "🇫🇷🇩🇪 flags", "emoji😀in😀text", "😀😃😄😁",
    "🧑🏾‍💻", "❤️", "☃", "🤷‍♀️", "a👍b", "👍 👍  👍",
    "e\u0301", "Zalgo: Z\u0334\u0321\u0319a\u0337l\u0336g\u0337o\u0338", "ñ vs n\u0303",
    "\u0301 leading combining", "a\u0300\u0301\u0302\u0303", "Å vs A\u030a",
    "def f(x):\n    return x**2  # comment\n", "if (a != b) { return -1; }",
    "<html><body class=\"x\">&amp;</body></html>", "C:\\Program Files\\", "a//b/c",
    "https://example.com/path?q=1&r=2#frag", "foo@example.org", "#include <stdio.h>",
    "x = [1, 2, 3]; y = {'a': 1}", "$$E = mc^2$$", "--flag=value", "....", "!!!???", "~~~",
    "\x00 nul", "\x7f del", "\x01\x02\x03", "\u200b zero width", "\ufeff BOM",
    "\u200d joiner \u200c non-joiner", "𝔾𝕠𝕠𝕕 𝕞𝕠𝕣𝕟𝕚𝕟𝕘", "ﬁ ligature ﬂ", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ",
    "™ © ® ℃ №", "Ⅻ ⅱ", "µ Ω Å K", "ǅungla Ǆ ǆ", "ﾊﾝｶｸ ｶﾀｶﾅ",
    "a" * 3000, "ab" * 500, "xyz" * 150 + " " + "q" * 200, "é" * 300, "日" * 200, "😀" * 100,
    "\U0001F600" * 3 + " " * 5 + "\U00010400",
]


def _random_cases(count=600, seed=1234):
    """Seeded random strings mixing every kind of character above."""
    pool = []
    for case in SPECIAL_CASES + CORNER_CASES:
        if len(case) < 60:
            pool.extend(case)
    pool = sorted(set(pool))
    pieces = ["<|im_start|>", "<|im_end|>", "<|image|>", "<row_3_col_4>", "<mask>", "zzword",
              "'s", "'LL", " ", "  ", "\n", "\r\n", "\t", "123", "ǅx", "e\u0301", "👨‍👩‍👧"]
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        out = []
        for _ in range(rng.randint(1, 40)):
            out.append(rng.choice(pieces) if rng.random() < 0.15 else rng.choice(pool))
        cases.append("".join(out))
    return cases


def corner_cases():
    return SPECIAL_CASES + CORNER_CASES + _random_cases()
