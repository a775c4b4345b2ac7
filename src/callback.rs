//! Callback URLs: where a webhook announces an execution's end. Only their form is checked
//! here (when a workflow is registered or an execution started); where they may point
//! (no loopback, private or link-local address unless allowed) is checked by the delivery
//! loop when it resolves them, since a name can resolve differently later.

/// The longest callback URL accepted.
pub const MAX_CALLBACK_LEN: usize = 2048;

/// Whether `url` can be a callback: `http://` or `https://`, a host, no credentials,
/// ASCII without white space or control characters, at most [`MAX_CALLBACK_LEN`] bytes.
pub(crate) fn check(url: &str) -> Result<(), &'static str> {
    if url.len() > MAX_CALLBACK_LEN {
        return Err("it is longer than 2048 bytes");
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("it contains white space or control characters");
    }
    if !url.is_ascii() {
        return Err(
            "it is not ASCII (write an international host in punycode, a path percent-encoded)",
        );
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or("it must start with http:// or https://")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err("it must not carry credentials (user:password@): sign with a secret instead");
    }
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    if host.is_empty() {
        return Err("it has no host");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn callback_forms() {
        for good in [
            "https://hooks.example.com/confluo",
            "http://10.0.0.7:8080/x?y=1",
            "https://[2001:db8::1]:443/",
        ] {
            assert_eq!(check(good), Ok(()), "{good}");
        }
        for bad in [
            "ftp://example.com/",
            "https:///path",
            "https://user:pw@example.com/",
            "https://exa mple.com/",
            "https://bücher.example/",
            "example.com",
            "",
        ] {
            assert!(check(bad).is_err(), "{bad}");
        }
        assert!(check(&format!("https://e.com/{}", "a".repeat(2048))).is_err());
    }
}
