{{/* The stage Jobs, each as one named template rendered into the pipeline-templates ConfigMap, from
     which the driver (mode pipeline) and the gate Jobs (mode manual) create them. Call with
     (dict "root" $ "round" R): R is the round as a string, or "__SAPD_ROUND__", which the driver replaces
     with the round it starts; "" means no round (build-prefixes). The teacher-scores and train commands
     take `--rounds __SAPD_ROUNDS__`: the rounds the Job serves (1 for per-round Jobs; a persistent Job's
     workers stay up for all of them, each round once its input is committed: sapd.workerArgs).
     `manual` true (the gate Jobs Helm renders) adds a name suffix from a hash of the release's values:
     Jobs are immutable, so an upgrade that changes any value replaces the gates (new names; Helm deletes
     the old ones, the new ones adopt the stage Jobs, which belong to the ConfigMap) instead of patching
     them, and an upgrade that changes nothing leaves them running. */}}

{{- define "sapd.buildPrefixesJob" -}}
{{- $c := dict "root" .root "component" "build-prefixes" "job" .root.Values.buildPrefixes "round" "" }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: build-prefixes
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          args: [python, -m, sapd.jobs.build_prefixes, --config, /etc/sapd/config.yaml]
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}
