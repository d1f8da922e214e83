//! In-test HTTP servers: a scripted OpenAI-compatible model and a delivery receiver.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A request the stub received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The `messages` of a chat completion request.
    pub fn messages(&self) -> Vec<serde_json::Value> {
        self.json()["messages"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The text of its last message ("" when it has none).
    pub fn last_text(&self) -> String {
        self.messages()
            .last()
            .and_then(|m| m["content"].as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

/// What the stub answers.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay: Duration,
    /// Close the connection without an answer (a server that resets or crashes mid-request).
    pub hang_up: bool,
}

impl Reply {
    pub fn json(status: u16, body: serde_json::Value) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: body.to_string(),
            delay: Duration::ZERO,
            hang_up: false,
        }
    }

    pub fn raw(status: u16, body: &str) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: body.to_string(),
            delay: Duration::ZERO,
            hang_up: false,
        }
    }

    pub fn after(mut self, delay: Duration) -> Reply {
        self.delay = delay;
        self
    }

    /// Reads the request, then closes the connection without answering.
    pub fn hang_up() -> Reply {
        Reply {
            hang_up: true,
            ..Reply::raw(0, "")
        }
    }

    /// The reply with the `usage` a Chat Completions server reports (`cached` prompt tokens
    /// served from its cache, as llama.cpp and OpenAI report them).
    pub fn with_usage(mut self, prompt: u64, cached: u64, completion: u64) -> Reply {
        if let Ok(mut body) = serde_json::from_str::<serde_json::Value>(&self.body) {
            body["usage"] = serde_json::json!({"prompt_tokens": prompt,
                "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}});
            self.body = body.to_string();
        }
        self
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// A Chat Completions answer carrying `message`.
    pub fn completion(message: serde_json::Value) -> Reply {
        Reply::json(
            200,
            serde_json::json!({"id": "cmpl", "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}),
        )
    }

    pub fn answer(text: &str) -> Reply {
        Reply::completion(serde_json::json!({"role": "assistant", "content": text}))
    }

    pub fn tool_call(id: &str, name: &str, arguments: serde_json::Value) -> Reply {
        Reply::completion(serde_json::json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": id, "type": "function",
                "function": {"name": name, "arguments": arguments.to_string()}}]}))
    }
}

type Handler = dyn Fn(&Received, usize) -> Reply + Send + Sync;

/// A tiny HTTP/1.1 server on loopback. Each connection serves one request and closes.
pub struct Stub {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Received>>>,
}

impl Stub {
    /// `handler(request, index)` decides each answer; `index` counts requests from 0.
    pub fn start(handler: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) -> Stub {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind stub");
        let addr = listener.local_addr().expect("stub addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let log = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let handler = handler.clone();
                let log = log.clone();
                std::thread::spawn(move || serve(stream, &*handler, &log));
            }
        });
        Stub { addr, received }
    }

    /// A stub that answers the scripted replies in order, then repeats the last one.
    pub fn scripted(replies: Vec<Reply>) -> Stub {
        Stub::start(move |_, index| replies[index.min(replies.len() - 1)].clone())
    }

    /// The `[model]` section that points agentgate at this stub, with no retries: every model
    /// call the test scripts is made exactly once.
    pub fn model_section(&self) -> String {
        format!(
            "[model]\nbackend = \"openai\"\nbase_url = \"{}/v1\"\nmodel = \"stub\"\nrequest_timeout = \"60s\"\nmax_retries = 0\n",
            self.url()
        )
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Received> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

fn serve(stream: TcpStream, handler: &Handler, log: &Mutex<Vec<Received>>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() {
            return;
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.push((name.trim().to_string(), value.trim().to_string()));
        }
    }
    let length: usize = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let request = Received {
        method,
        path,
        headers,
        body,
    };
    let index = {
        let Ok(mut log) = log.lock() else { return };
        log.push(request.clone());
        log.len() - 1
    };
    let reply = handler(&request, index);
    std::thread::sleep(reply.delay);
    if reply.hang_up {
        return;
    }
    let mut response = format!(
        "HTTP/1.1 {} Stub\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        reply.status,
        reply.body.len()
    );
    for (name, value) in &reply.headers {
        response.push_str(&format!("{name}: {value}\r\n"));
    }
    response.push_str("\r\n");
    response.push_str(&reply.body);
    let mut stream = stream;
    let _ = stream.write_all(response.as_bytes());
}
