//! An export in PostgreSQL: `jsonb` for JSON (with its exact text beside
//! it), `timestamptz`, `uuid`, `bytea`; every table written with `COPY ...
//! FROM STDIN BINARY` inside one transaction, DDL included, so a failure
//! (the connection killed midway too) leaves the database as it was.
//!
//! The export runs on one thread: a current-thread tokio runtime drives the
//! connection while the caller feeds rows synchronously from the redb
//! snapshot.

use std::pin::Pin;

use bytes::{BufMut, BytesMut};
use futures_util::StreamExt;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use tokio_postgres::{Client, NoTls};

use super::schema::{RelTable, Ty, Value, META_TABLE, TABLES};
use super::{judge_origin, judge_target, Origin, Target};
use crate::model::Millis;

/// How long connecting may take before the export gives up.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn sql_type(ty: Ty) -> &'static str {
    match ty {
        Ty::Text => "text",
        Ty::Json => "jsonb",
        Ty::Bytes => "bytea",
        Ty::Int => "bigint",
        Ty::Bool => "boolean",
        Ty::Time => "timestamptz",
        Ty::Uuid => "uuid",
    }
}

/// The physical columns of a table: a JSON column is two (`name` jsonb,
/// `name_text` text).
fn physical(t: &RelTable) -> Vec<(String, Type)> {
    let mut out = Vec::new();
    for c in t.columns {
        let ty = match c.ty {
            Ty::Text => Type::TEXT,
            Ty::Json => Type::JSONB,
            Ty::Bytes => Type::BYTEA,
            Ty::Int => Type::INT8,
            Ty::Bool => Type::BOOL,
            Ty::Time => Type::TIMESTAMPTZ,
            Ty::Uuid => Type::UUID,
        };
        out.push((c.name.to_string(), ty));
        if c.ty == Ty::Json {
            out.push((format!("{}_text", c.name), Type::TEXT));
        }
    }
    out
}

fn create_table_sql(t: &RelTable) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in t.columns {
        let null = if c.nullable { "" } else { " NOT NULL" };
        if c.ty == Ty::Json {
            parts.push(format!("\"{}\" jsonb", c.name));
            parts.push(format!("\"{}_text\" text{null}", c.name));
        } else {
            parts.push(format!("\"{}\" {}{null}", c.name, sql_type(c.ty)));
        }
    }
    let key: Vec<String> = t.primary_key.iter().map(|k| format!("\"{k}\"")).collect();
    parts.push(format!("PRIMARY KEY ({})", key.join(", ")));
    for (column, parent) in t.references {
        parts.push(format!(
            "FOREIGN KEY (\"{column}\") REFERENCES \"{parent}\" (\"build_id\")"
        ));
    }
    format!(
        "CREATE TABLE \"{}\" (\n  {}\n)",
        t.name,
        parts.join(",\n  ")
    )
}

/// The DDL of an export, as `docs/export-schema.md` shows it.
pub fn ddl() -> String {
    let mut out = format!(
        "CREATE TABLE \"{META_TABLE}\" (\"key\" text PRIMARY KEY, \"value\" text NOT NULL);\n"
    );
    for t in TABLES {
        out.push_str(&create_table_sql(t));
        out.push_str(";\n");
    }
    out
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the PostgreSQL client: {e}"))
}

/// What went wrong talking to the server, without the URL (it may hold a
/// password): the caller names the server by its identity.
fn pg_error(identity: &str, e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "PostgreSQL {identity}: {} (SQLSTATE {})",
            db.message(),
            db.code().code()
        ),
        None => format!("PostgreSQL {identity}: {e}"),
    }
}

fn connect(
    rt: &tokio::runtime::Runtime,
    url: &str,
    identity: &str,
) -> Result<(Client, tokio::task::JoinHandle<()>), String> {
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|_| format!("{identity} is not a PostgreSQL URL"))?;
    config.connect_timeout(CONNECT_TIMEOUT);
    let (client, connection) = rt
        .block_on(config.connect(NoTls))
        .map_err(|e| format!("cannot connect to {}", pg_error(identity, e)))?;
    let driver = rt.spawn(async move {
        let _ = connection.await;
    });
    Ok((client, driver))
}

async fn table_names(client: &Client) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT table_name::text FROM information_schema.tables \
             WHERE table_schema = current_schema()",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

async fn schema_version(client: &Client) -> Result<Option<u32>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            &format!("SELECT \"value\" FROM \"{META_TABLE}\" WHERE \"key\" = 'schema_version'"),
            &[],
        )
        .await?;
    Ok(row.and_then(|r| r.get::<_, String>(0).parse().ok()))
}

/// A connection inside its transaction, with what the database holds.
struct Opened {
    rt: tokio::runtime::Runtime,
    client: Client,
    /// Tables of the current schema.
    names: Vec<String>,
    /// `berth_meta`'s schema version, when there is one.
    version: Option<u32>,
}

impl Opened {
    fn begin(url: &str, identity: &str, begin: &str) -> Result<Opened, String> {
        let rt = runtime()?;
        let (client, _driver) = connect(&rt, url, identity)?;
        let fail = |e| pg_error(identity, e);
        rt.block_on(client.batch_execute(begin)).map_err(fail)?;
        let names = rt.block_on(table_names(&client)).map_err(fail)?;
        let version = if names.iter().any(|n| n == META_TABLE) {
            rt.block_on(schema_version(&client)).map_err(fail)?
        } else {
            None
        };
        Ok(Opened {
            rt,
            client,
            names,
            version,
        })
    }
}

/// A cell in the binary COPY stream.
#[derive(Debug)]
enum Cell<'a> {
    Null,
    Text(&'a str),
    /// jsonb's binary form is a version byte (1) and the text.
    Jsonb(&'a str),
    Bytes(&'a [u8]),
    Int(i64),
    Bool(bool),
    Time(time::OffsetDateTime),
    Uuid(uuid::Uuid),
}

impl ToSql for Cell<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Cell::Null => Ok(IsNull::Yes),
            Cell::Text(s) => s.to_sql(ty, out),
            Cell::Jsonb(s) => {
                out.put_u8(1);
                out.put_slice(s.as_bytes());
                Ok(IsNull::No)
            }
            Cell::Bytes(b) => b.to_sql(ty, out),
            Cell::Int(n) => n.to_sql(ty, out),
            Cell::Bool(b) => b.to_sql(ty, out),
            Cell::Time(t) => t.to_sql(ty, out),
            Cell::Uuid(u) => u.to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        // The column types come from the same table definition.
        true
    }

    to_sql_checked!();
}

fn to_time(ms: Millis) -> Result<time::OffsetDateTime, String> {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .map_err(|_| "a time is out of range".to_string())
}

fn from_time(t: time::OffsetDateTime) -> Result<Millis, String> {
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000)
        .map_err(|_| "a time is out of range".to_string())
}

/// PostgreSQL's text and jsonb cannot hold a NUL character.
fn jsonb_can_hold(text: &str) -> bool {
    !text.contains("\\u0000")
}

pub struct PgTarget {
    rt: tokio::runtime::Runtime,
    client: Client,
    identity: String,
    copy: Option<(&'static RelTable, Pin<Box<BinaryCopyInWriter>>)>,
}

impl PgTarget {
    pub fn open(url: &str, identity: &str, replace: bool) -> Result<PgTarget, String> {
        let Opened {
            rt,
            client,
            names,
            version,
        } = Opened::begin(url, identity, "BEGIN ISOLATION LEVEL SERIALIZABLE")?;
        let fail = |e| pg_error(identity, e);
        let drop_ours = judge_target(&names, version, replace, identity)?;
        let mut ddl = String::new();
        if drop_ours {
            for t in TABLES.iter().rev() {
                ddl.push_str(&format!("DROP TABLE IF EXISTS \"{}\";\n", t.name));
            }
            ddl.push_str(&format!("DROP TABLE IF EXISTS \"{META_TABLE}\";\n"));
        }
        ddl.push_str(&self::ddl());
        rt.block_on(client.batch_execute(&ddl)).map_err(fail)?;
        Ok(PgTarget {
            rt,
            client,
            identity: identity.to_string(),
            copy: None,
        })
    }
}

impl Target for PgTarget {
    fn begin_table(&mut self, table: &'static RelTable) -> Result<(), String> {
        let columns = physical(table);
        let names: Vec<String> = columns.iter().map(|(n, _)| format!("\"{n}\"")).collect();
        let types: Vec<Type> = columns.into_iter().map(|(_, t)| t).collect();
        let sql = format!(
            "COPY \"{}\" ({}) FROM STDIN BINARY",
            table.name,
            names.join(", ")
        );
        let sink = self
            .rt
            .block_on(self.client.copy_in(&sql))
            .map_err(|e| pg_error(&self.identity, e))?;
        self.copy = Some((table, Box::pin(BinaryCopyInWriter::new(sink, &types))));
        Ok(())
    }

    fn row(&mut self, values: &[Value]) -> Result<(), String> {
        let (table, copy) = self
            .copy
            .as_mut()
            .ok_or_else(|| "a row outside a table".to_string())?;
        let mut cells: Vec<Cell<'_>> = Vec::with_capacity(values.len() + 4);
        for (v, column) in values.iter().zip(table.columns) {
            match v {
                // A NULL JSON value is NULL in both its columns.
                Value::Null if column.ty == Ty::Json => cells.extend([Cell::Null, Cell::Null]),
                Value::Null => cells.push(Cell::Null),
                Value::Text(s) => cells.push(Cell::Text(s)),
                Value::Json(s) => {
                    cells.push(if jsonb_can_hold(s) {
                        Cell::Jsonb(s)
                    } else {
                        Cell::Null
                    });
                    cells.push(Cell::Text(s));
                }
                Value::Bytes(b) => cells.push(Cell::Bytes(b)),
                Value::Int(n) => cells.push(Cell::Int(*n)),
                Value::Bool(b) => cells.push(Cell::Bool(*b)),
                Value::Time(t) => cells.push(Cell::Time(to_time(*t)?)),
                Value::Uuid(id) => cells.push(Cell::Uuid(uuid::Uuid::from_u128(*id))),
            }
        }
        self.rt
            .block_on(copy.as_mut().write_raw(cells.iter()))
            .map_err(|e| pg_error(&self.identity, e))
    }

    fn end_table(&mut self) -> Result<(), String> {
        if let Some((_, mut copy)) = self.copy.take() {
            self.rt
                .block_on(copy.as_mut().finish())
                .map_err(|e| pg_error(&self.identity, e))?;
        }
        Ok(())
    }

    fn commit(self: Box<Self>, meta: &[(&str, String)]) -> Result<(), String> {
        let fail = |e| pg_error(&self.identity, e);
        for (key, value) in meta {
            self.rt
                .block_on(self.client.execute(
                    &format!("INSERT INTO \"{META_TABLE}\" (\"key\", \"value\") VALUES ($1, $2)"),
                    &[key, value],
                ))
                .map_err(fail)?;
        }
        self.rt
            .block_on(self.client.batch_execute("COMMIT"))
            .map_err(fail)?;
        Ok(())
    }
}

pub struct PgOrigin {
    rt: tokio::runtime::Runtime,
    client: Client,
    identity: String,
    version: u32,
}

impl PgOrigin {
    pub fn open(url: &str, identity: &str) -> Result<PgOrigin, String> {
        // One snapshot for every table read.
        let Opened {
            rt,
            client,
            names,
            version,
        } = Opened::begin(
            url,
            identity,
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
        )?;
        let version = judge_origin(&names, version, identity)?;
        Ok(PgOrigin {
            rt,
            client,
            identity: identity.to_string(),
            version,
        })
    }
}

impl Origin for PgOrigin {
    fn version(&self) -> u32 {
        self.version
    }

    fn rows(
        &mut self,
        table: &'static RelTable,
        each: &mut dyn FnMut(Vec<Value>) -> Result<(), String>,
    ) -> Result<(), String> {
        // A JSON column is read from its exact text.
        let names: Vec<String> = table
            .columns
            .iter()
            .map(|c| match c.ty {
                Ty::Json => format!("\"{}_text\"", c.name),
                _ => format!("\"{}\"", c.name),
            })
            .collect();
        let key: Vec<String> = table
            .primary_key
            .iter()
            .map(|k| format!("\"{k}\""))
            .collect();
        let sql = format!(
            "SELECT {} FROM \"{}\" ORDER BY {}",
            names.join(", "),
            table.name,
            key.join(", ")
        );
        let identity = self.identity.clone();
        let fail = |e| pg_error(&identity, e);
        let stream = self
            .rt
            .block_on(
                self.client
                    .query_raw(&sql, std::iter::empty::<&(dyn ToSql + Sync)>()),
            )
            .map_err(fail)?;
        let mut stream = Box::pin(stream);
        while let Some(row) = self.rt.block_on(stream.next()) {
            let row = row.map_err(fail)?;
            let mut values = Vec::with_capacity(table.columns.len());
            for (i, column) in table.columns.iter().enumerate() {
                let wrong = |_| {
                    format!(
                        "{identity}: {}.{} holds a value of the wrong type",
                        table.name, column.name
                    )
                };
                let value = match column.ty {
                    Ty::Text => row
                        .try_get::<_, Option<String>>(i)
                        .map(|v| v.map(Value::Text)),
                    Ty::Json => row
                        .try_get::<_, Option<String>>(i)
                        .map(|v| v.map(Value::Json)),
                    Ty::Bytes => row
                        .try_get::<_, Option<Vec<u8>>>(i)
                        .map(|v| v.map(Value::Bytes)),
                    Ty::Int => row.try_get::<_, Option<i64>>(i).map(|v| v.map(Value::Int)),
                    Ty::Bool => row
                        .try_get::<_, Option<bool>>(i)
                        .map(|v| v.map(Value::Bool)),
                    Ty::Uuid => row
                        .try_get::<_, Option<uuid::Uuid>>(i)
                        .map(|v| v.map(|u| Value::Uuid(u.as_u128()))),
                    Ty::Time => match row.try_get::<_, Option<time::OffsetDateTime>>(i) {
                        Ok(Some(t)) => Ok(Some(Value::Time(from_time(t)?))),
                        Ok(None) => Ok(None),
                        Err(e) => Err(e),
                    },
                }
                .map_err(wrong)?;
                values.push(value.unwrap_or(Value::Null));
            }
            each(values)?;
        }
        Ok(())
    }
}
