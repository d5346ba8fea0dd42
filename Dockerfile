# model-residency operator image.
#
#   docker build -t model-residency:0.1.0 .
#
# Build stage: a release binary; the runtime stage is distroless (no shell,
# no package manager) and runs as the non-root user 65532, matching the
# chart's securityContext (runAsNonRoot, readOnlyRootFilesystem).
FROM rust:1.95-bookworm AS build
WORKDIR /src
ENV CARGO_BUILD_JOBS=2
# Dependencies first, so source edits reuse the cached layer.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && for b in simulate control_plane cluster; do echo 'fn main() {}' > benches/$b.rs; done \
    && cargo build --release --locked --bin model-residency \
    && rm -rf src benches
COPY src ./src
COPY benches ./benches
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin model-residency

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/model-residency /usr/local/bin/model-residency
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/model-residency"]
CMD ["run", "--log-format=json"]
