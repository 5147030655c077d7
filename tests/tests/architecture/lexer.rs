//! The architecture test's lexer: Rust source reduced to code tokens (comments, string and
//! char literals blanked, line numbers kept), and the paths of a use tree read from them.

/// A token of code: an identifier, `::`, or one punctuation character; with its line.
#[derive(Debug)]
pub(crate) struct Token {
    pub(crate) text: String,
    pub(crate) line: usize,
}

pub(crate) fn tokens(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token {
                text: chars[start..i].iter().collect(),
                line,
            });
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push(Token {
                text: "::".to_owned(),
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                text: c.to_string(),
                line,
            });
            i += 1;
        }
    }
    out
}

/// `src` with comments, string literals and char literals blanked out (newlines kept, so line
/// numbers stay true).
pub(crate) fn code_only(src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |out: &mut String, text: &[char]| {
        out.extend(text.iter().map(|&c| if c == '\n' { '\n' } else { ' ' }));
    };
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let rest = &chars[i..];
        let after_ident = i > 0 && ident(chars[i - 1]);
        let end = if rest.starts_with(&['/', '/']) {
            rest.iter().position(|&c| c == '\n').unwrap_or(rest.len())
        } else if rest.starts_with(&['/', '*']) {
            let mut depth = 0;
            let mut j = 0;
            loop {
                if j + 1 >= rest.len() {
                    break rest.len();
                }
                if rest[j] == '/' && rest[j + 1] == '*' {
                    depth += 1;
                    j += 2;
                } else if rest[j] == '*' && rest[j + 1] == '/' {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break j;
                    }
                } else {
                    j += 1;
                }
            }
        } else if !after_ident && let Some(len) = raw_string_len(rest) {
            len
        } else if rest[0] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            (j + 1).min(rest.len())
        } else if rest[0] == '\'' && rest.get(1) == Some(&'\\') {
            // An escape: `'\''`, `'\n'`, `'\u{..}'`; the escaped character is skipped.
            rest.get(3..)
                .and_then(|tail| tail.iter().position(|&c| c == '\''))
                .map_or(rest.len(), |p| p + 4)
        } else if rest[0] == '\'' && rest.get(2) == Some(&'\'') {
            3
        } else {
            out.push(rest[0]);
            i += 1;
            continue;
        };
        blank(&mut out, &rest[..end]);
        i += end;
    }
    out
}

/// The length of a raw string literal (`r"..."`, `r#"..."#`, `br"..."`) at the start of
/// `rest`, if one starts there.
fn raw_string_len(rest: &[char]) -> Option<usize> {
    let mut j = usize::from(rest.first() == Some(&'b'));
    if rest.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = rest[j..].iter().take_while(|&&c| c == '#').count();
    j += hashes;
    if rest.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < rest.len() {
        if rest[j] == '"'
            && rest[j + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(rest.len())
}

/// The first name of each branch of the use tree (or path) starting at `tokens[at]`: `x::..`
/// gives `x`, `{x::a, y, z::{..}}` gives `x, y, z`.
pub(crate) fn tree_heads(tokens: &[Token], at: usize) -> Vec<String> {
    let Some(first) = tokens.get(at) else {
        return Vec::new();
    };
    if first.text != "{" {
        return vec![first.text.clone()];
    }
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect_head = true;
    for token in &tokens[at..] {
        match token.text.as_str() {
            "{" => {
                depth += 1;
                expect_head = depth == 1;
            }
            "}" => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            "," if depth == 1 => expect_head = true,
            text if expect_head && depth == 1 => {
                heads.push(text.to_owned());
                expect_head = false;
            }
            _ => {}
        }
    }
    heads
}

/// Every path of the use tree (or inline path) starting at `tokens[at]`, as its names:
/// `x::{a, b::{c, d}}` gives `x::a`, `x::b::c`, `x::b::d`. A path ends at the first token that is
/// not a name followed by `::`.
pub(crate) fn tree_paths(tokens: &[Token], at: usize) -> Vec<Vec<String>> {
    fn subtree(tokens: &[Token], mut at: usize, prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
        let mut prefix = prefix;
        loop {
            let Some(token) = tokens.get(at) else {
                return (vec![prefix], at);
            };
            if token.text == "{" {
                let mut out = Vec::new();
                at += 1;
                loop {
                    match tokens.get(at).map(|t| t.text.as_str()) {
                        None => return (out, at),
                        Some("}") => return (out, at + 1),
                        Some(",") => at += 1,
                        Some(_) => {
                            let (paths, end) = subtree(tokens, at, prefix.clone());
                            out.extend(paths);
                            // Skip what follows the path (`as name`, `*`) up to `,` or `}`.
                            at = end.max(at + 1);
                            while let Some(t) = tokens.get(at) {
                                if t.text == "," || t.text == "}" {
                                    break;
                                }
                                at += 1;
                            }
                        }
                    }
                }
            }
            let is_name = token.text.chars().all(|c| c.is_alphanumeric() || c == '_');
            if !is_name {
                return (vec![prefix], at);
            }
            prefix.push(token.text.clone());
            if tokens.get(at + 1).is_some_and(|t| t.text == "::") {
                at += 2;
            } else {
                return (vec![prefix], at + 1);
            }
        }
    }
    subtree(tokens, at, Vec::new()).0
}
