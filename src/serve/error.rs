//! Errors as the OpenAI API writes them:
//! `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }
    /// 400: the request is wrong.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    /// 400 about one field.
    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = Self::invalid(message);
        e.param = Some(param.to_string());
        e
    }
    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            .code("invalid_api_key")
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).code("queue_full")
    }
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            message,
        )
    }
    pub fn method_not_allowed(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        // A busy or loading server is worth retrying: say when.
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

impl From<crate::Error> for ApiError {
    fn from(e: crate::Error) -> ApiError {
        match e {
            crate::Error::Input(m) => ApiError::invalid(m),
            e @ crate::Error::TokenOutOfRange { .. } => ApiError::invalid(e.to_string()),
            e => ApiError::internal(e.to_string()),
        }
    }
}
