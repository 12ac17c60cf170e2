//! Filters on sidecar columns (`filter="quality_flags & 0b101 == 0 and label is not null"`):
//! parsed once, checked against a schema (each name a column, each operation typed), then
//! evaluated row by row. The order deals only the rows a filter keeps (`order::Selected`).
//!
//! Grammar, loosest first (`docs/order.md`, "Filters"):
//!
//! ```text
//! expr    := and ("or" and)*
//! and     := not ("and" not)*
//! not     := "not" not | "(" expr ")" | test
//! test    := value "is" ["not"] "null" | value CMP value
//! value   := term (("&" | "|") term)*          integers only
//! term    := COLUMN | INT | FLOAT | STRING | "(" value ")"
//! CMP     := "==" | "!=" | "<" | "<=" | ">" | ">="
//! ```
//!
//! Integers are decimal, `0x` or `0b`; strings are quoted with `'` or `"`. Bitwise `&` and `|`
//! bind tighter than comparisons (as in Python). A comparison with a null is false (`!=` too);
//! `is null` is true only for a nullable column's null. Columns may be `int64`, `float64`
//! (nullable or not) or `str`.

use crate::format::{ColumnType, Schema, Value, NULL_INT64};

/// A parse or type error, with the column or token it is about.
pub type FilterError = String;

/// A parsed filter, not yet bound to a schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    text: String,
    expr: Expr,
    /// The columns it reads, each once, in the order they appear.
    cols: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Or(Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Not(Box<Expr>),
    IsNull(Term, bool),
    Cmp(Term, Cmp, Term),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, PartialEq)]
enum Term {
    Column(String),
    Int(i64),
    Float(f64),
    Str(String),
    BitAnd(Box<Term>, Box<Term>),
    BitOr(Box<Term>, Box<Term>),
}

/// A value while evaluating.
#[derive(Debug, Clone, PartialEq)]
enum V<'a> {
    Null,
    Int(i64),
    Float(f64),
    Str(&'a str),
}

/// The kind of a term's values, checked before any row is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Str,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Int(i64),
    Float(f64),
    Str(String),
    Op(&'static str),
}

const OPS: [&str; 10] = ["==", "!=", "<=", ">=", "<", ">", "&", "|", "(", ")"];

fn lex(text: &str) -> Result<Vec<Tok>, FilterError> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if let Some(op) = OPS.iter().find(|op| text[i..].starts_with(**op)) {
            out.push(Tok::Op(op));
            i += op.len();
        } else if c == b'\'' || c == b'"' {
            let end = text[i + 1..]
                .find(c as char)
                .ok_or_else(|| format!("a string opened at character {i} is not closed"))?;
            out.push(Tok::Str(text[i + 1..i + 1 + end].to_owned()));
            i += end + 2;
        } else if c.is_ascii_digit() || (c == b'-' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) {
            let end = text[i + 1..]
                .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '.' || ch == '_'))
                .map_or(b.len(), |e| i + 1 + e);
            out.push(number(&text[i..end])?);
            i = end;
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let end = text[i..]
                .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .map_or(b.len(), |e| i + e);
            out.push(Tok::Ident(text[i..end].to_owned()));
            i = end;
        } else {
            return Err(format!("unexpected {:?} at character {i}", c as char));
        }
    }
    Ok(out)
}

fn number(t: &str) -> Result<Tok, FilterError> {
    let (neg, body) = t.strip_prefix('-').map_or((false, t), |r| (true, r));
    let body = body.replace('_', "");
    let int = if let Some(h) = body.strip_prefix("0x") {
        i64::from_str_radix(h, 16).ok()
    } else if let Some(bits) = body.strip_prefix("0b") {
        i64::from_str_radix(bits, 2).ok()
    } else {
        body.parse::<i64>().ok()
    };
    match int {
        Some(v) => Ok(Tok::Int(if neg { -v } else { v })),
        None => t
            .replace('_', "")
            .parse::<f64>()
            .map(Tok::Float)
            .map_err(|_| format!("{t:?} is not a number")),
    }
}

struct Parser {
    toks: Vec<Tok>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at)
    }
    fn word(&self, w: &str) -> bool {
        matches!(self.peek(), Some(Tok::Ident(x)) if x.eq_ignore_ascii_case(w))
    }
    fn op(&self, o: &str) -> bool {
        matches!(self.peek(), Some(Tok::Op(x)) if *x == o)
    }
    fn expect_op(&mut self, o: &str) -> Result<(), FilterError> {
        if !self.op(o) {
            return Err(format!("expected {o:?}, found {}", self.found()));
        }
        self.at += 1;
        Ok(())
    }
    fn found(&self) -> String {
        match self.peek() {
            None => "the end".into(),
            Some(t) => format!("{t:?}"),
        }
    }
    /// `next (word next)*`, folded left with `make`.
    fn chain(
        &mut self,
        word: &str,
        next: fn(&mut Self) -> Result<Expr, FilterError>,
        make: fn(Box<Expr>, Box<Expr>) -> Expr,
    ) -> Result<Expr, FilterError> {
        let mut e = next(self)?;
        while self.word(word) {
            self.at += 1;
            e = make(Box::new(e), Box::new(next(self)?));
        }
        Ok(e)
    }
    fn expr(&mut self) -> Result<Expr, FilterError> {
        self.chain("or", Self::and, Expr::Or)
    }
    fn and(&mut self) -> Result<Expr, FilterError> {
        self.chain("and", Self::not, Expr::And)
    }
    fn not(&mut self) -> Result<Expr, FilterError> {
        if self.word("not") {
            self.at += 1;
            return Ok(Expr::Not(Box::new(self.not()?)));
        }
        // A parenthesis opens an expression unless what it holds is a value (`(a & 1) == 0`).
        if self.op("(") {
            let save = self.at;
            self.at += 1;
            if let Ok(e) = self.expr() {
                if self.op(")") {
                    self.at += 1;
                    if !self.is_cmp() && !self.op("&") && !self.op("|") && !self.word("is") {
                        return Ok(e);
                    }
                }
            }
            self.at = save;
        }
        self.test()
    }
    fn is_cmp(&self) -> bool {
        ["==", "!=", "<", "<=", ">", ">="].iter().any(|o| self.op(o))
    }
    fn test(&mut self) -> Result<Expr, FilterError> {
        let left = self.value()?;
        if self.word("is") {
            self.at += 1;
            let negated = self.word("not");
            if negated {
                self.at += 1;
            }
            if !self.word("null") {
                return Err(format!("expected null after 'is', found {}", self.found()));
            }
            self.at += 1;
            return Ok(Expr::IsNull(left, !negated));
        }
        let cmp = match self.peek() {
            Some(Tok::Op("==")) => Cmp::Eq,
            Some(Tok::Op("!=")) => Cmp::Ne,
            Some(Tok::Op("<")) => Cmp::Lt,
            Some(Tok::Op("<=")) => Cmp::Le,
            Some(Tok::Op(">")) => Cmp::Gt,
            Some(Tok::Op(">=")) => Cmp::Ge,
            _ => return Err(format!("expected a comparison or 'is null', found {}", self.found())),
        };
        self.at += 1;
        Ok(Expr::Cmp(left, cmp, self.value()?))
    }
    fn value(&mut self) -> Result<Term, FilterError> {
        let mut t = self.term()?;
        loop {
            if self.op("&") {
                self.at += 1;
                t = Term::BitAnd(Box::new(t), Box::new(self.term()?));
            } else if self.op("|") {
                self.at += 1;
                t = Term::BitOr(Box::new(t), Box::new(self.term()?));
            } else {
                return Ok(t);
            }
        }
    }
    fn term(&mut self) -> Result<Term, FilterError> {
        let t = match self.peek().cloned() {
            Some(Tok::Op("(")) => {
                self.at += 1;
                let v = self.value()?;
                self.expect_op(")")?;
                return Ok(v);
            }
            Some(Tok::Ident(n)) if ["and", "or", "not", "is", "null"].contains(&n.to_ascii_lowercase().as_str()) => {
                return Err(format!("expected a column or a literal, found {n:?}"))
            }
            Some(Tok::Ident(n)) => Term::Column(n),
            Some(Tok::Int(v)) => Term::Int(v),
            Some(Tok::Float(v)) => Term::Float(v),
            Some(Tok::Str(v)) => Term::Str(v),
            _ => return Err(format!("expected a column or a literal, found {}", self.found())),
        };
        self.at += 1;
        Ok(t)
    }
}

impl Filter {
    /// Parses `text`.
    pub fn parse(text: &str) -> Result<Filter, FilterError> {
        let mut p = Parser {
            toks: lex(text)?,
            at: 0,
        };
        if p.toks.is_empty() {
            return Err("an empty filter".into());
        }
        let expr = p.expr()?;
        if p.at != p.toks.len() {
            return Err(format!("unexpected {} after a complete filter", p.found()));
        }
        let mut cols: Vec<String> = Vec::new();
        walk_expr(&expr, &mut |t| {
            if let Term::Column(c) = t {
                if !cols.contains(c) {
                    cols.push(c.clone());
                }
            }
        });
        Ok(Filter {
            text: text.trim().to_owned(),
            expr,
            cols,
        })
    }

    /// The text it was parsed from (trimmed).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The columns it reads, each once, in the order they appear.
    pub fn columns(&self) -> &[String] {
        &self.cols
    }

    /// Checks the filter against `schema`: every name a column of a type a filter reads, and
    /// every operation on values of kinds it takes. Returns the columns it reads (as
    /// [`Filter::columns`]), their nullability in the same order.
    pub fn check(&self, schema: &Schema) -> Result<Vec<bool>, FilterError> {
        let mut nullable = Vec::with_capacity(self.cols.len());
        for c in &self.cols {
            let col = schema
                .columns
                .iter()
                .find(|x| &x.name == c)
                .ok_or_else(|| format!("no column {c:?} (the columns are {})", schema.describe()))?;
            if !matches!(col.ty, ColumnType::Int64 | ColumnType::Float64 | ColumnType::Str) {
                return Err(format!(
                    "column {c:?} is {}; a filter reads int64, float64 and str columns",
                    col.type_name()
                ));
            }
            nullable.push(col.nullable);
        }
        check_expr(&self.expr, schema)?;
        Ok(nullable)
    }

    /// Whether the row whose filter columns (in [`Filter::columns`]' order, nullability as
    /// [`Filter::check`] gave) hold `vals` is kept.
    pub fn keeps(&self, vals: &[&Value], nullable: &[bool]) -> bool {
        let at = |name: &str| -> V<'_> {
            let k = self.cols.iter().position(|c| c == name).expect("a checked column");
            match vals[k] {
                Value::Int64(x) if nullable[k] && *x == NULL_INT64 => V::Null,
                Value::Float64(x) if nullable[k] && x.is_nan() => V::Null,
                Value::Int64(x) => V::Int(*x),
                Value::Float64(x) => V::Float(*x),
                Value::Str(s) => V::Str(s),
                _ => V::Null,
            }
        };
        eval(&self.expr, &at)
    }
}

fn walk_expr(e: &Expr, f: &mut impl FnMut(&Term)) {
    match e {
        Expr::Or(a, b) | Expr::And(a, b) => {
            walk_expr(a, f);
            walk_expr(b, f);
        }
        Expr::Not(a) => walk_expr(a, f),
        Expr::IsNull(t, _) => walk_term(t, f),
        Expr::Cmp(a, _, b) => {
            walk_term(a, f);
            walk_term(b, f);
        }
    }
}

fn walk_term(t: &Term, f: &mut impl FnMut(&Term)) {
    f(t);
    if let Term::BitAnd(a, b) | Term::BitOr(a, b) = t {
        walk_term(a, f);
        walk_term(b, f);
    }
}

fn kind(t: &Term, schema: &Schema) -> Result<Kind, FilterError> {
    Ok(match t {
        Term::Int(_) => Kind::Int,
        Term::Float(_) => Kind::Float,
        Term::Str(_) => Kind::Str,
        Term::Column(c) => match schema.columns.iter().find(|x| &x.name == c).map(|x| x.ty) {
            Some(ColumnType::Int64) => Kind::Int,
            Some(ColumnType::Float64) => Kind::Float,
            _ => Kind::Str,
        },
        Term::BitAnd(a, b) | Term::BitOr(a, b) => {
            for x in [a, b] {
                if kind(x, schema)? != Kind::Int {
                    return Err(format!("{} is not an integer: '&' and '|' take integers", show(x)));
                }
            }
            Kind::Int
        }
    })
}

fn check_expr(e: &Expr, schema: &Schema) -> Result<(), FilterError> {
    match e {
        Expr::Or(a, b) | Expr::And(a, b) => {
            check_expr(a, schema)?;
            check_expr(b, schema)
        }
        Expr::Not(a) => check_expr(a, schema),
        Expr::IsNull(t, _) => kind(t, schema).map(|_| ()),
        Expr::Cmp(a, _, b) => {
            let (ka, kb) = (kind(a, schema)?, kind(b, schema)?);
            if (ka == Kind::Str) != (kb == Kind::Str) {
                return Err(format!(
                    "{} and {} cannot be compared (text with a number)",
                    show(a),
                    show(b)
                ));
            }
            Ok(())
        }
    }
}

fn show(t: &Term) -> String {
    match t {
        Term::Column(c) => format!("column {c:?}"),
        Term::Int(v) => v.to_string(),
        Term::Float(v) => v.to_string(),
        Term::Str(s) => format!("{s:?}"),
        Term::BitAnd(a, b) => format!("({} & {})", show(a), show(b)),
        Term::BitOr(a, b) => format!("({} | {})", show(a), show(b)),
    }
}

fn value<'a>(t: &'a Term, at: &impl Fn(&str) -> V<'a>) -> V<'a> {
    match t {
        Term::Column(c) => at(c),
        Term::Int(v) => V::Int(*v),
        Term::Float(v) => V::Float(*v),
        Term::Str(s) => V::Str(s),
        Term::BitAnd(a, b) | Term::BitOr(a, b) => match (value(a, at), value(b, at)) {
            (V::Int(x), V::Int(y)) if matches!(t, Term::BitAnd(..)) => V::Int(x & y),
            (V::Int(x), V::Int(y)) => V::Int(x | y),
            _ => V::Null,
        },
    }
}

fn eval<'a>(e: &'a Expr, at: &impl Fn(&str) -> V<'a>) -> bool {
    match e {
        Expr::Or(a, b) => eval(a, at) || eval(b, at),
        Expr::And(a, b) => eval(a, at) && eval(b, at),
        Expr::Not(a) => !eval(a, at),
        Expr::IsNull(t, want) => (value(t, at) == V::Null) == *want,
        Expr::Cmp(a, c, b) => {
            let ord = match (value(a, at), value(b, at)) {
                (V::Int(x), V::Int(y)) => x.partial_cmp(&y),
                (V::Int(x), V::Float(y)) => (x as f64).partial_cmp(&y),
                (V::Float(x), V::Int(y)) => x.partial_cmp(&(y as f64)),
                (V::Float(x), V::Float(y)) => x.partial_cmp(&y),
                (V::Str(x), V::Str(y)) => x.partial_cmp(y),
                _ => None,
            };
            let Some(o) = ord else { return false };
            use std::cmp::Ordering::*;
            match c {
                Cmp::Eq => o == Equal,
                Cmp::Ne => o != Equal,
                Cmp::Lt => o == Less,
                Cmp::Le => o != Greater,
                Cmp::Gt => o == Greater,
                Cmp::Ge => o != Less,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Column;

    fn schema() -> Schema {
        let c = |n: &str, ty, nullable| Column {
            name: n.into(),
            ty,
            nullable,
        };
        Schema::from_columns(vec![
            c("flags", ColumnType::Int64, false),
            c("label", ColumnType::Int64, true),
            c("score", ColumnType::Float64, false),
            c("mime", ColumnType::Str, false),
            c("boxes", ColumnType::Json, false),
        ])
        .unwrap()
    }

    fn keeps(text: &str, flags: i64, label: i64, score: f64, mime: &str) -> bool {
        let f = Filter::parse(text).unwrap();
        let s = schema();
        let nullable = f.check(&s).unwrap();
        let row = [
            ("flags", Value::Int64(flags)),
            ("label", Value::Int64(label)),
            ("score", Value::Float64(score)),
            ("mime", Value::Str(mime.into())),
        ];
        let vals: Vec<&Value> = f
            .columns()
            .iter()
            .map(|c| &row.iter().find(|(n, _)| n == c).unwrap().1)
            .collect();
        f.keeps(&vals, &nullable)
    }

    #[test]
    fn flags_masks_nulls_and_text() {
        let q = "flags & 0b101 == 0";
        assert!(keeps(q, 0b010, 1, 0.0, "x"));
        assert!(!keeps(q, 0b100, 1, 0.0, "x"));
        assert!(!keeps(q, 0b001, 1, 0.0, "x"));
        assert!(keeps("label is not null", 0, 3, 0.0, ""));
        assert!(!keeps("label is not null", 0, NULL_INT64, 0.0, ""));
        assert!(keeps("label is null", 0, NULL_INT64, 0.0, ""));
        // A comparison with a null is false, `!=` too.
        assert!(!keeps("label != 3", 0, NULL_INT64, 0.0, ""));
        assert!(keeps("label != 3", 0, 4, 0.0, ""));
        assert!(keeps("score >= 0.5 and mime == 'image/webp'", 0, 0, 0.5, "image/webp"));
        assert!(!keeps(
            "score >= 0.5 and mime == \"image/webp\"",
            0,
            0,
            0.4,
            "image/webp"
        ));
        assert!(keeps("not (flags & 0x4 != 0) or label < 0", 4, -1, 0.0, ""));
        assert!(keeps(
            "(flags | 1) == 1 and (label > 2 or label is null)",
            0,
            NULL_INT64,
            0.0,
            ""
        ));
        assert!(keeps("score > 1", 0, 0, 1.5, ""));
        assert!(keeps("flags == -2", -2, 0, 0.0, ""));
    }

    #[test]
    fn bad_filters_are_refused_naming_what_is_wrong() {
        let s = schema();
        let err = |t: &str| match Filter::parse(t) {
            Err(e) => e,
            Ok(f) => f.check(&s).unwrap_err(),
        };
        assert!(err("nope == 1").contains("no column \"nope\""), "{}", err("nope == 1"));
        assert!(err("boxes == 1").contains("is json"));
        assert!(err("mime == 1").contains("cannot be compared"));
        assert!(err("score & 1 == 0").contains("not an integer"));
        assert!(err("flags ==").contains("expected a column"));
        assert!(err("flags == 1 label").contains("after a complete filter"));
        assert!(err("mime == 'x").contains("not closed"));
        assert!(err("").contains("empty"));
        assert!(err("flags = 1").contains("unexpected"));
        assert_eq!(Filter::parse(" a == 1 and b is null ").unwrap().columns(), ["a", "b"]);
    }
}
