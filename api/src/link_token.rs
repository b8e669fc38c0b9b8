//! The fulfilment links' cryptography: the token in the request mail's link to the provider's fulfilment page,
//! and the page's form token. Both the mail (the controllers) and the page (the manager binary)
//! use this module; it does no I/O.
//!
//! A token is the object's identity sealed with an AEAD (AES-256-GCM, from `ring`): its kind,
//! namespace, name and UID, an expiry, and a digest of the request mail's Message-Id. Sealed, not
//! only signed, so that the link names no object in the clear (a mail archive or a proxy log
//! shows an opaque string); authenticated, so that no one without the key can make or alter one.
//! The page opens it, finds the object by namespace and name, and accepts the link only while
//! the object has the same UID (a deleted and recreated object of the same name is refused) and
//! its request record carries the same Message-Id.
//!
//! The key material comes from a Secret: one key per line, newest first ([`Keys::parse`]).
//! Links are sealed with the newest key and opened with any listed key, so rotation has an
//! overlap window as long as the old key stays listed; removing a key revokes every link sealed
//! with it. Each key is expanded with HKDF-SHA256 into three independent keys: the AEAD key, the
//! key of the synthetic nonce, and the form-token key.
//!
//! The nonce is synthetic (an HMAC of the plaintext, cut to 96 bits), so sealing is
//! deterministic: the same object, Message-Id and expiry give the same link, and a mail sent
//! again after a crash carries the same text. Two different plaintexts never share a nonce
//! except by a collision of the HMAC.
//!
//! Caveats: a link is a bearer capability, like a password-reset link: whoever holds the mail
//! can use it until it expires, the object is fulfilled, the key is rotated out, or the object
//! carries [`crate::names::FULFILMENT_REVOKED_ANNOTATION`]. See docs/fulfilment.md.

use std::{
    collections::BTreeMap,
    fmt,
    sync::{Arc, RwLock},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use ring::{
    aead::{self, Aad, LessSafeKey, Nonce, UnboundKey},
    digest, hkdf, hmac,
};

use crate::records::{Which, read_records};

/// How long a link is valid after its request mail, unless configured otherwise.
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);
/// The longest a link may be valid: 90 days (a link is a bearer credential).
pub const MAX_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// The path of the page, followed by the token.
pub const PATH_PREFIX: &str = "/fulfil/";
/// The shortest key accepted, in bytes (after base64 decoding).
pub const MIN_KEY_BYTES: usize = 32;
/// The most keys one Secret may list.
pub const MAX_KEYS: usize = 8;
/// The longest token accepted (a name of 253 and a namespace of 63 characters fit).
pub const MAX_TOKEN_CHARS: usize = 800;

const VERSION: u8 = 1;
const NONCE_LEN: usize = aead::NONCE_LEN;
const DIGEST_LEN: usize = 16;
const HKDF_SALT: &[u8] = b"cluster-api-provider-mailgun fulfilment v1";

/// The kinds a link can fulfil.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `MailgunCluster`.
    MailgunCluster,
    /// `MailgunMachine`.
    MailgunMachine,
    /// `MailgunRemediation`: the link answers a repair request (repaired / cannot repair).
    MailgunRemediation,
}

impl Kind {
    /// The kind's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MailgunCluster => "MailgunCluster",
            Self::MailgunMachine => "MailgunMachine",
            Self::MailgunRemediation => "MailgunRemediation",
        }
    }

    /// The kind named `kind`, if a link can fulfil it.
    pub fn from_name(kind: &str) -> Option<Self> {
        match kind {
            "MailgunCluster" => Some(Self::MailgunCluster),
            "MailgunMachine" => Some(Self::MailgunMachine),
            "MailgunRemediation" => Some(Self::MailgunRemediation),
            _ => None,
        }
    }

    fn byte(self) -> u8 {
        match self {
            Self::MailgunCluster => 1,
            Self::MailgunMachine => 2,
            Self::MailgunRemediation => 3,
        }
    }

    fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(Self::MailgunCluster),
            2 => Some(Self::MailgunMachine),
            3 => Some(Self::MailgunRemediation),
            _ => None,
        }
    }
}

/// What a token says: which object, for which request mail, until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// The object's kind.
    pub kind: Kind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID when the mail was composed.
    pub uid: String,
    /// Seconds since the epoch after which the token is refused.
    pub expires: u64,
    message_id_digest: [u8; DIGEST_LEN],
}

impl Claims {
    /// Claims for the request mail `message_id` of the object, valid until `expires` (seconds
    /// since the epoch).
    pub fn new(
        kind: Kind,
        namespace: &str,
        name: &str,
        uid: &str,
        message_id: &str,
        expires: u64,
    ) -> Self {
        Self {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
            expires,
            message_id_digest: message_id_digest(message_id),
        }
    }

    /// True when the token was made for the request mail `message_id`.
    pub fn for_message_id(&self, message_id: &str) -> bool {
        self.message_id_digest == message_id_digest(message_id)
    }

    /// Whether the object found under the token's namespace and name, with `meta`, is the one
    /// the token was made for: the same UID (not a recreated object of the same name), its
    /// request record carrying the token's Message-Id, and no
    /// [`crate::names::FULFILMENT_REVOKED_ANNOTATION`].
    ///
    /// # Errors
    /// The first found of [`FulfilError::OtherObject`], [`FulfilError::Revoked`] and
    /// [`FulfilError::OtherRequest`].
    pub fn check_object(
        &self,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> Result<(), FulfilError> {
        if meta.uid.as_deref() != Some(self.uid.as_str())
            || meta.namespace.as_deref() != Some(self.namespace.as_str())
            || meta.name.as_deref() != Some(self.name.as_str())
        {
            return Err(FulfilError::OtherObject);
        }
        let empty = BTreeMap::new();
        let annotations = meta.annotations.as_ref().unwrap_or(&empty);
        if annotations.contains_key(crate::names::FULFILMENT_REVOKED_ANNOTATION) {
            return Err(FulfilError::Revoked);
        }
        let records = read_records(annotations, self.kind.as_str(), Which::Request);
        let recorded = records
            .sent
            .and_then(|s| s.message_id)
            .or(records.intent.map(|i| i.message_id));
        match recorded {
            Some(id) if self.for_message_id(&id) => Ok(()),
            _ => Err(FulfilError::OtherRequest),
        }
    }

    fn encode(&self) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(64 + self.namespace.len() + self.name.len());
        out.push(self.kind.byte());
        out.extend_from_slice(&self.expires.to_be_bytes());
        out.extend_from_slice(&self.message_id_digest);
        for field in [&self.uid, &self.namespace, &self.name] {
            out.push(u8::try_from(field.len()).ok()?);
            out.extend_from_slice(field.as_bytes());
        }
        Some(out)
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (&kind, rest) = bytes.split_first()?;
        let (expires, rest) = rest.split_first_chunk::<8>()?;
        let (digest, mut rest) = rest.split_first_chunk::<DIGEST_LEN>()?;
        let mut fields = Vec::with_capacity(3);
        for _ in 0..3 {
            let (&len, tail) = rest.split_first()?;
            let (field, tail) = tail.split_at_checked(usize::from(len))?;
            fields.push(String::from_utf8(field.to_vec()).ok()?);
            rest = tail;
        }
        if !rest.is_empty() {
            return None;
        }
        let name = fields.pop()?;
        let namespace = fields.pop()?;
        let uid = fields.pop()?;
        Some(Self {
            kind: Kind::from_byte(kind)?,
            namespace,
            name,
            uid,
            expires: u64::from_be_bytes(*expires),
            message_id_digest: *digest,
        })
    }
}

fn message_id_digest(message_id: &str) -> [u8; DIGEST_LEN] {
    let full = digest::digest(&digest::SHA256, message_id.as_bytes());
    let mut out = [0; DIGEST_LEN];
    out.copy_from_slice(&full.as_ref()[..DIGEST_LEN]);
    out
}

/// Why a key list or a token was refused. Never contains key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FulfilError {
    /// The key list holds no key.
    #[error("the fulfilment key list holds no key")]
    NoKeys,
    /// A line of the key list is not base64 of at least [`MIN_KEY_BYTES`] bytes.
    #[error(
        "line {line} of the fulfilment key list is not base64 of at least {MIN_KEY_BYTES} bytes"
    )]
    BadKey {
        /// The line, from 1.
        line: usize,
    },
    /// The key list holds more than [`MAX_KEYS`] keys.
    #[error("the fulfilment key list holds more than {MAX_KEYS} keys")]
    TooManyKeys,
    /// The token is not one this provider makes (wrong shape, or no listed key opens it:
    /// altered, forged, or sealed with a key no longer listed).
    #[error("the link is not valid")]
    Invalid,
    /// The token was valid until `expires` (seconds since the epoch).
    #[error("the link expired")]
    Expired {
        /// When it expired.
        expires: u64,
    },
    /// A genuine token, but the object under its name is another one (deleted and recreated
    /// under the same name: another UID).
    #[error("the object was recreated since the link was mailed")]
    OtherObject,
    /// A genuine token, but the object's request record names another mail (or none).
    #[error("the link belongs to another request mail")]
    OtherRequest,
    /// A genuine token, but the object carries the revocation annotation.
    #[error("the object's links are revoked")]
    Revoked,
}

impl FulfilError {
    /// A short label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::NoKeys | Self::BadKey { .. } | Self::TooManyKeys => "keys",
            Self::Invalid => "invalid",
            Self::Expired { .. } => "expired",
            Self::OtherObject => "recreated",
            Self::OtherRequest => "other_request",
            Self::Revoked => "revoked",
        }
    }
}

/// One listed key, expanded into its three purposes.
struct Key {
    seal: LessSafeKey,
    nonce: hmac::Key,
    form: hmac::Key,
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

impl Key {
    /// The nonce sealing `plaintext` under this key: its HMAC, cut to 96 bits.
    fn synthetic_nonce(&self, plaintext: &[u8]) -> Option<[u8; NONCE_LEN]> {
        hmac::sign(&self.nonce, plaintext).as_ref()[..NONCE_LEN]
            .try_into()
            .ok()
    }

    fn derive(material: &[u8]) -> Option<Self> {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(material);
        let expand = |info: &'static [u8], len: usize| -> Option<Vec<u8>> {
            let mut out = vec![0; len];
            prk.expand(&[info], Len(len)).ok()?.fill(&mut out).ok()?;
            Some(out)
        };
        let seal = expand(b"seal", aead::AES_256_GCM.key_len())?;
        let nonce = expand(b"nonce", 32)?;
        let form = expand(b"form", 32)?;
        Some(Self {
            seal: LessSafeKey::new(UnboundKey::new(&aead::AES_256_GCM, &seal).ok()?),
            nonce: hmac::Key::new(hmac::HMAC_SHA256, &nonce),
            form: hmac::Key::new(hmac::HMAC_SHA256, &form),
        })
    }
}

/// The listed keys, newest first. `Debug` shows how many, never the keys.
pub struct Keys(Vec<Key>);

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Keys({} listed)", self.0.len())
    }
}

impl Keys {
    /// Reads a key list: one key per line, base64 (standard or URL-safe, padded or not) of at
    /// least [`MIN_KEY_BYTES`] random bytes, newest first (it seals; all open). Blank lines and
    /// lines starting with `#` are skipped. `head -c 32 /dev/urandom | base64` makes a key.
    ///
    /// # Errors
    /// [`FulfilError::NoKeys`], [`FulfilError::BadKey`] or [`FulfilError::TooManyKeys`].
    pub fn parse(text: &str) -> Result<Self, FulfilError> {
        let mut keys = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = FulfilError::BadKey { line: index + 1 };
            let material = decode_base64(line).ok_or(bad.clone())?;
            if material.len() < MIN_KEY_BYTES {
                return Err(bad);
            }
            keys.push(Key::derive(&material).ok_or(bad)?);
            if keys.len() > MAX_KEYS {
                return Err(FulfilError::TooManyKeys);
            }
        }
        if keys.is_empty() {
            return Err(FulfilError::NoKeys);
        }
        Ok(Self(keys))
    }

    /// How many keys are listed.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a key list holds at least one key.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The token of `claims`, sealed with the newest key; `None` when a field is longer than
    /// 255 bytes (namespaces, names and UIDs never are).
    pub fn seal(&self, claims: &Claims) -> Option<String> {
        let key = self.0.first()?;
        let mut payload = claims.encode()?;
        let nonce = key.synthetic_nonce(&payload)?;
        key.seal
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from([VERSION]),
                &mut payload,
            )
            .ok()?;
        let mut token = Vec::with_capacity(1 + NONCE_LEN + payload.len());
        token.push(VERSION);
        token.extend_from_slice(&nonce);
        token.extend_from_slice(&payload);
        Some(URL_SAFE_NO_PAD.encode(token))
    }

    /// The claims of `token` if a listed key opens it and it has not expired at `now`.
    ///
    /// # Errors
    /// [`FulfilError::Invalid`] for anything not sealed by a listed key (the answer does not say
    /// which); [`FulfilError::Expired`] for a genuine token past its expiry.
    pub fn open(&self, token: &str, now: SystemTime) -> Result<Claims, FulfilError> {
        if token.len() > MAX_TOKEN_CHARS {
            return Err(FulfilError::Invalid);
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| FulfilError::Invalid)?;
        let (&version, rest) = bytes.split_first().ok_or(FulfilError::Invalid)?;
        let (nonce, sealed) = rest
            .split_first_chunk::<NONCE_LEN>()
            .ok_or(FulfilError::Invalid)?;
        if version != VERSION {
            return Err(FulfilError::Invalid);
        }
        let claims = self
            .0
            .iter()
            .find_map(|key| {
                let mut buffer = sealed.to_vec();
                let plain = key
                    .seal
                    .open_in_place(
                        Nonce::assume_unique_for_key(*nonce),
                        Aad::from([VERSION]),
                        &mut buffer,
                    )
                    .ok()?;
                // Only the nonce this key derives from the plaintext: a token sealed under
                // another nonce (by whoever learnt the key, or two sealings under one nonce)
                // is no token of ours.
                let expected = key.synthetic_nonce(plain)?;
                equal_in_constant_time(&expected, nonce).then_some(())?;
                Claims::decode(plain)
            })
            .ok_or(FulfilError::Invalid)?;
        if unix_seconds(now) >= claims.expires {
            return Err(FulfilError::Expired {
                expires: claims.expires,
            });
        }
        Ok(claims)
    }

    /// The page's form token for the link `token` and the browser's cookie value `cookie`
    /// (made with the newest key).
    pub fn form_token(&self, token: &str, cookie: &str) -> String {
        self.0.first().map_or_else(String::new, |key| {
            URL_SAFE_NO_PAD.encode(hmac::sign(&key.form, &form_input(token, cookie)))
        })
    }

    /// True when `form` is the form token of `token` and `cookie` under a listed key (compared
    /// in constant time).
    pub fn check_form_token(&self, token: &str, cookie: &str, form: &str) -> bool {
        let Ok(tag) = URL_SAFE_NO_PAD.decode(form) else {
            return false;
        };
        let input = form_input(token, cookie);
        self.0
            .iter()
            .any(|key| hmac::verify(&key.form, &input, &tag).is_ok())
    }
}

fn form_input(token: &str, cookie: &str) -> Vec<u8> {
    let mut input = Vec::with_capacity(token.len() + cookie.len() + 1);
    input.extend_from_slice(token.as_bytes());
    input.push(0);
    input.extend_from_slice(cookie.as_bytes());
    input
}

/// Whether `a` and `b` hold the same bytes, in a time that depends only on their length.
fn equal_in_constant_time(a: &[u8; NONCE_LEN], b: &[u8; NONCE_LEN]) -> bool {
    let difference = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(difference) == 0
}

fn decode_base64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE};
    [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
}

fn unix_seconds(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The key list in use, replaced whole when its Secret changes. Clones share it.
#[derive(Clone)]
pub struct KeyRing(Arc<RwLock<Arc<Keys>>>);

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyRing").field(&self.current()).finish()
    }
}

impl KeyRing {
    /// A ring holding `keys`.
    pub fn new(keys: Keys) -> Self {
        Self(Arc::new(RwLock::new(Arc::new(keys))))
    }

    /// The keys in use now.
    pub fn current(&self) -> Arc<Keys> {
        Arc::clone(&self.0.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Uses `keys` from now on.
    pub fn replace(&self, keys: Keys) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
    }
}

/// What the controllers need to put a link in a request mail.
#[derive(Debug, Clone)]
pub struct Links {
    /// The page's public base URL (`fulfilment.url`), without the path.
    pub base_url: String,
    /// How long a link is valid after its mail.
    pub validity: Duration,
    /// The keys.
    pub keys: KeyRing,
}

impl Links {
    /// The link for the request mail of the object of `kind` with `meta`, composed at `now`; the
    /// Message-Id is the request record's (else the deterministic one on `domain`), and the
    /// expiry counts from the record's time (else `now`), rounded up to the hour, so that a mail
    /// composed again for the same request carries the same link. `None` for an object without
    /// UID, namespace or name, or of a kind no link fulfils.
    pub fn link(
        &self,
        kind: &str,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        domain: &str,
        now: SystemTime,
    ) -> Option<String> {
        self.sealed_link(Kind::from_name(kind)?, meta, domain, None, now)
    }

    /// The link of a `MailgunRemediation`'s repair mail and of each of its reminders: it answers
    /// the repair request (repaired / cannot repair) on the page. Sealed for the repair mail
    /// (the object's request record, [`crate::records::Which::Request`], else its deterministic
    /// Message-Id on `domain`), so a reminder's link is checked against the repair mail's
    /// record, and it expires [`Links::validity`] after `mail_at`, rounded up to the hour:
    /// pass the time the mail being composed was first intended (the repair mail's or the
    /// reminder's intent record), so that a mail composed again after a crash carries the same
    /// link and a late reminder's link outlives it. `None` for an object without UID, namespace
    /// or name.
    pub fn repair_link(
        &self,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        domain: &str,
        mail_at: SystemTime,
    ) -> Option<String> {
        self.sealed_link(
            Kind::MailgunRemediation,
            meta,
            domain,
            Some(unix_seconds(mail_at)),
            mail_at,
        )
    }

    fn sealed_link(
        &self,
        kind_of: Kind,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        domain: &str,
        from: Option<u64>,
        now: SystemTime,
    ) -> Option<String> {
        let kind = kind_of.as_str();
        let (uid, namespace, name) = (
            meta.uid.as_deref()?,
            meta.namespace.as_deref()?,
            meta.name.as_deref()?,
        );
        let empty = BTreeMap::new();
        let annotations = meta.annotations.as_ref().unwrap_or(&empty);
        let intent = read_records(annotations, kind, Which::Request).intent;
        let message_id = intent.as_ref().map_or_else(
            || Which::Request.message_id(kind, uid, domain),
            |i| i.message_id.clone(),
        );
        let from = from.unwrap_or_else(|| {
            intent
                .and_then(|i| i.at)
                .and_then(|at| u64::try_from(at.as_second()).ok())
                .unwrap_or_else(|| unix_seconds(now))
        });
        let expires = from
            .saturating_add(self.validity.as_secs())
            .div_ceil(3600)
            .saturating_mul(3600);
        let claims = Claims::new(kind_of, namespace, name, uid, &message_id, expires);
        let token = self.keys.current().seal(&claims)?;
        Some(format!(
            "{}{PATH_PREFIX}{token}",
            self.base_url.trim_end_matches('/')
        ))
    }

    /// The paragraph the request mail ends with: the link and what it allows; empty when no
    /// link can be made for the object.
    pub fn mail_paragraph(
        &self,
        kind: &str,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        domain: &str,
        now: SystemTime,
    ) -> String {
        link_paragraph(
            self.link(kind, meta, domain, now),
            "record it through this page instead",
        )
    }

    /// The paragraph a `MailgunRemediation`'s repair mail and each reminder end with: the
    /// [`Links::repair_link`] and what it allows; empty when no link can be made.
    pub fn repair_paragraph(
        &self,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        domain: &str,
        mail_at: SystemTime,
    ) -> String {
        link_paragraph(
            self.repair_link(meta, domain, mail_at),
            "answer through this page instead: repaired, or cannot repair",
        )
    }
}

/// The paragraph a mail ends with: its `link`, what to do there and who can use it; empty
/// without a link.
fn link_paragraph(link: Option<String>, what: &str) -> String {
    link.map(|link| {
        format!(
            "\nWithout access to the management cluster, {what}\n(anyone holding this mail can \
             use the link, once; do not forward it):\n\n  {link}\n"
        )
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    const KEY_A: &str = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";
    const KEY_B: &str = "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkI=";

    fn keys(text: &str) -> Keys {
        Keys::parse(text).unwrap()
    }

    fn claims(uid: &str, expires: u64) -> Claims {
        Claims::new(
            Kind::MailgunMachine,
            "team-a",
            "m-0",
            uid,
            "<mailgunmachine.u-1@mg.example.com>",
            expires,
        )
    }

    /// Links to `https://capm.example.com/fulfil/...` (`base_url` with or without its slash),
    /// sealed with `KEY_A`.
    fn links(base_url: &str) -> Links {
        Links {
            base_url: base_url.into(),
            validity: DEFAULT_VALIDITY,
            keys: KeyRing::new(keys(KEY_A)),
        }
    }

    /// The claims of a link `links` made, opened at `now`.
    fn open(links: &Links, link: &str, now: SystemTime) -> Claims {
        let token = link
            .strip_prefix("https://capm.example.com/fulfil/")
            .unwrap();
        links.keys.current().open(token, now).unwrap()
    }

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds)
    }

    #[test]
    fn a_sealed_token_opens_to_its_claims_and_names_nothing_in_the_clear() {
        let k = keys(KEY_A);
        let c = claims("u-1", 1000);
        let token = k.seal(&c).unwrap();
        assert_eq!(k.open(&token, at(999)).unwrap(), c);
        for clear in ["team-a", "m-0", "u-1", "Machine", "mailgunmachine"] {
            assert!(!token.contains(clear), "{clear} in {token}");
        }
        // Deterministic: the same claims, the same link.
        assert_eq!(k.seal(&c).unwrap(), token);
        assert_ne!(k.seal(&claims("u-2", 1000)).unwrap(), token);
        assert!(c.for_message_id("<mailgunmachine.u-1@mg.example.com>"));
        assert!(!c.for_message_id("<mailgunmachine.u-2@mg.example.com>"));
    }

    #[test]
    fn an_expired_token_is_refused() {
        let k = keys(KEY_A);
        let token = k.seal(&claims("u-1", 1000)).unwrap();
        assert_eq!(
            k.open(&token, at(1000)),
            Err(FulfilError::Expired { expires: 1000 })
        );
    }

    #[test]
    fn forged_and_altered_tokens_are_refused() {
        let k = keys(KEY_A);
        let token = k.seal(&claims("u-1", 1000)).unwrap();
        let mut bytes = URL_SAFE_NO_PAD.decode(&token).unwrap();
        for index in [0, 5, bytes.len() / 2, bytes.len() - 1] {
            let mut altered = bytes.clone();
            altered[index] ^= 1;
            assert_eq!(
                k.open(&URL_SAFE_NO_PAD.encode(altered), at(0)),
                Err(FulfilError::Invalid),
                "byte {index} flipped"
            );
        }
        bytes.truncate(bytes.len() - 1);
        for forged in [
            URL_SAFE_NO_PAD.encode(&bytes),
            String::new(),
            "not base64!".into(),
            "A".repeat(MAX_TOKEN_CHARS + 1),
            URL_SAFE_NO_PAD.encode([1u8; 64]),
        ] {
            assert_eq!(k.open(&forged, at(0)), Err(FulfilError::Invalid));
        }
    }

    /// Issue 54: the plaintext sealed again, under the right key, with a nonce of the
    /// sealer's choice (as whoever learnt the key, or a nonce reuse, could).
    #[test]
    fn a_token_resealed_under_another_nonce_is_refused() {
        let k = keys(KEY_A);
        let c = claims("u-1", 1000);
        let key = &k.0[0];
        let genuine = URL_SAFE_NO_PAD.decode(k.seal(&c).unwrap()).unwrap();
        let mut nonce: [u8; NONCE_LEN] = genuine[1..=NONCE_LEN].try_into().unwrap();
        nonce[0] ^= 1;
        let mut payload = c.encode().unwrap();
        key.seal
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from([VERSION]),
                &mut payload,
            )
            .unwrap();
        let mut token = vec![VERSION];
        token.extend_from_slice(&nonce);
        token.extend_from_slice(&payload);
        assert_eq!(
            k.open(&URL_SAFE_NO_PAD.encode(token), at(0)),
            Err(FulfilError::Invalid)
        );
        assert!(equal_in_constant_time(&nonce, &nonce));
        assert!(!equal_in_constant_time(&nonce, &[0; NONCE_LEN]));
    }

    #[test]
    fn a_token_of_another_key_is_refused() {
        let token = keys(KEY_B).seal(&claims("u-1", 1000)).unwrap();
        assert_eq!(keys(KEY_A).open(&token, at(0)), Err(FulfilError::Invalid));
    }

    #[test]
    fn rotation_seals_with_the_newest_key_and_opens_with_any_listed() {
        let old = keys(KEY_A);
        let token = old.seal(&claims("u-1", 1000)).unwrap();
        // Rotated: the new key first, the old one kept for the overlap window.
        let rotated = keys(&format!("# new\n{KEY_B}\n\n{KEY_A}\n"));
        assert_eq!(rotated.len(), 2);
        assert!(rotated.open(&token, at(0)).is_ok());
        let new_token = rotated.seal(&claims("u-1", 1000)).unwrap();
        assert_ne!(new_token, token);
        assert!(keys(KEY_B).open(&new_token, at(0)).is_ok());
        // The overlap ends: the old key removed, its links are refused.
        assert_eq!(keys(KEY_B).open(&token, at(0)), Err(FulfilError::Invalid));
    }

    fn object(uid: &str, record_uid: Option<&str>) -> ObjectMeta {
        let annotations = record_uid.map(|u| {
            let record = serde_json::json!({
                "messageId": format!("<mailgunmachine.{u}@mg.example.com>"),
                "state": "sent",
                "backendId": "<x@mg.example.com>",
            });
            [(crate::names::MAIL_ANNOTATION.to_owned(), record.to_string())].into()
        });
        ObjectMeta {
            name: Some("m-0".into()),
            namespace: Some("team-a".into()),
            uid: Some(uid.into()),
            annotations,
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn only_the_object_and_request_mail_of_the_token_match() {
        let k = keys(KEY_A);
        let opened = k
            .open(&k.seal(&claims("u-1", 1000)).unwrap(), at(0))
            .unwrap();
        assert_eq!(opened.check_object(&object("u-1", Some("u-1"))), Ok(()));
        // Deleted and recreated under the same name: another UID (and its own request).
        assert_eq!(
            opened.check_object(&object("u-2", Some("u-2"))),
            Err(FulfilError::OtherObject)
        );
        // Another namespace or name never matches, even with the UID.
        let mut elsewhere = object("u-1", Some("u-1"));
        elsewhere.namespace = Some("team-b".into());
        assert_eq!(
            opened.check_object(&elsewhere),
            Err(FulfilError::OtherObject)
        );
        // No request record, or one of another mail.
        assert_eq!(
            opened.check_object(&object("u-1", None)),
            Err(FulfilError::OtherRequest)
        );
        assert_eq!(
            opened.check_object(&object("u-1", Some("u-7"))),
            Err(FulfilError::OtherRequest)
        );
        let mut revoked = object("u-1", Some("u-1"));
        if let Some(a) = revoked.annotations.as_mut() {
            a.insert(
                crate::names::FULFILMENT_REVOKED_ANNOTATION.into(),
                "yes".into(),
            );
        }
        assert_eq!(opened.check_object(&revoked), Err(FulfilError::Revoked));
    }

    #[test]
    fn key_lists_are_checked_and_never_shown() {
        assert_eq!(Keys::parse("").unwrap_err(), FulfilError::NoKeys);
        assert_eq!(Keys::parse("# only\n").unwrap_err(), FulfilError::NoKeys);
        assert_eq!(
            Keys::parse(&format!("{KEY_A}\nc2hvcnQ=\n")).unwrap_err(),
            FulfilError::BadKey { line: 2 }
        );
        assert_eq!(
            Keys::parse("not base64 at all").unwrap_err(),
            FulfilError::BadKey { line: 1 }
        );
        let many = [KEY_A; MAX_KEYS + 1].join("\n");
        assert_eq!(Keys::parse(&many).unwrap_err(), FulfilError::TooManyKeys);
        let ring = KeyRing::new(keys(KEY_A));
        let shown = format!("{ring:?}");
        assert!(
            !shown.contains(KEY_A) && shown.contains("1 listed"),
            "{shown}"
        );
        ring.replace(keys(&format!("{KEY_B}\n{KEY_A}")));
        assert_eq!(ring.current().len(), 2);
    }

    #[test]
    fn form_tokens_bind_the_link_and_the_cookie() {
        let k = keys(KEY_A);
        let form = k.form_token("tok", "cookie");
        assert!(k.check_form_token("tok", "cookie", &form));
        assert!(!k.check_form_token("tok", "other", &form));
        assert!(!k.check_form_token("other", "cookie", &form));
        assert!(!k.check_form_token("tok", "cookie", ""));
        assert!(!keys(KEY_B).check_form_token("tok", "cookie", &form));
        // Rotated: a page served before the rotation still submits.
        assert!(keys(&format!("{KEY_B}\n{KEY_A}")).check_form_token("tok", "cookie", &form));
    }

    /// Issue 56: a repair link names its kind, so a link of one kind never opens an object of
    /// another, even one of the same namespace, name and UID.
    #[test]
    fn a_repair_link_answers_only_its_remediation() {
        let links = links("https://capm.example.com");
        let record = serde_json::json!({
            "messageId": "<mailgunremediation.u-1@mg.example.com>",
            "state": "sent",
            "backendId": "<x@mg.example.com>",
        });
        let meta = ObjectMeta {
            name: Some("m-0".into()),
            namespace: Some("team-a".into()),
            uid: Some("u-1".into()),
            annotations: Some(
                [(crate::names::MAIL_ANNOTATION.to_owned(), record.to_string())].into(),
            ),
            ..ObjectMeta::default()
        };
        let sent = at(1_800_000_100);
        let link = links.repair_link(&meta, "mg.example.com", sent).unwrap();
        let opened = open(&links, &link, sent);
        assert_eq!(opened.kind, Kind::MailgunRemediation);
        assert_eq!(opened.check_object(&meta), Ok(()));
        assert!(opened.expires >= 1_800_000_100 + DEFAULT_VALIDITY.as_secs());
        // The same mail composed again: the same link; a reminder a day later: a later expiry,
        // still for the repair mail.
        assert_eq!(
            links.repair_link(&meta, "mg.example.com", sent + Duration::from_secs(60)),
            Some(link.clone())
        );
        let reminder = links
            .repair_link(&meta, "mg.example.com", sent + Duration::from_secs(86_400))
            .unwrap();
        let later = open(&links, &reminder, sent);
        assert!(later.expires > opened.expires);
        assert_eq!(later.check_object(&meta), Ok(()));
        // A cluster's or a machine's link for the same namespace, name and UID: its own kind,
        // checked against its own kind's record, which the remediation does not carry.
        for kind in [Kind::MailgunCluster, Kind::MailgunMachine] {
            let other = Claims {
                kind,
                ..opened.clone()
            };
            assert_eq!(other.check_object(&meta), Err(FulfilError::OtherRequest));
        }
        // And a repair link never opens as another kind.
        assert_eq!(
            Kind::from_name("MailgunRemediation"),
            Some(Kind::MailgunRemediation)
        );
        assert_eq!(Kind::from_name("MailgunRemediationTemplate"), None);
        let text = links.repair_paragraph(&meta, "mg.example.com", sent);
        assert!(
            text.contains(&link) && text.contains("cannot repair"),
            "{text}"
        );
        let no_uid = ObjectMeta { uid: None, ..meta };
        assert!(links.repair_paragraph(&no_uid, "d", sent).is_empty());
    }

    #[test]
    fn links_name_the_request_mail_and_expire_on_the_hour() {
        let links = links("https://capm.example.com/");
        let meta = ObjectMeta {
            name: Some("c".into()),
            namespace: Some("ns".into()),
            uid: Some("u-9".into()),
            ..ObjectMeta::default()
        };
        let now = at(1_800_000_100);
        let link = links
            .link("MailgunCluster", &meta, "mg.example.com", now)
            .unwrap();
        let opened = open(&links, &link, now);
        assert_eq!(
            (opened.kind, &*opened.namespace, &*opened.name, &*opened.uid),
            (Kind::MailgunCluster, "ns", "c", "u-9")
        );
        assert!(opened.for_message_id("<mailguncluster.u-9@mg.example.com>"));
        assert_eq!(opened.expires % 3600, 0);
        assert!(opened.expires >= 1_800_000_100 + DEFAULT_VALIDITY.as_secs());
        // Composed again a minute later: the same link.
        let later = now + Duration::from_secs(60);
        assert_eq!(
            links.link("MailgunCluster", &meta, "mg.example.com", later),
            Some(link)
        );
        assert!(
            links
                .mail_paragraph("MailgunMachineTemplate", &meta, "d", now)
                .is_empty()
        );
        let no_uid = ObjectMeta { uid: None, ..meta };
        assert_eq!(links.link("MailgunCluster", &no_uid, "d", now), None);
    }
}
