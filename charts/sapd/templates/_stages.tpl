{{/* The stage Jobs, each as one named template, so that the stand-alone Jobs (pipeline disabled) and
     the templates the pipeline driver creates Jobs from (pipeline-templates ConfigMap) are one source.
     Call with (dict "root" $ "round" R): R is the round as a string, or "__SAPD_ROUND__" for the
     driver, which replaces that placeholder with the round it starts; "" means no round (one Job per
     run: build-prefixes, or the stand-alone evaluate). A round Job is named "<release>-<stage>-r<R>". */}}

{{- define "sapd.stageName" -}}
{{- $base := include "sapd.name" . -}}
{{- if .round -}}
{{- printf "%s-r%s" ($base | trunc 52 | trimSuffix "-") .round -}}
{{- else -}}
{{- $base -}}
{{- end -}}
{{- end -}}

{{- define "sapd.stageMeta" -}}
name: {{ include "sapd.stageName" . }}
labels:
  {{- include "sapd.labels" . | nindent 2 }}
  {{- if .round }}
  sapd.io/round: {{ .round | quote }}
  {{- end }}
{{- end -}}

{{- define "sapd.buildPrefixesJob" -}}
{{- $c := dict "root" .root "component" "build-prefixes" "job" .root.Values.buildPrefixes "round" "" }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | nindent 2 }}
  template:
    metadata:
      labels:
        {{- include "sapd.selectorLabels" $c | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: build-prefixes
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          command: [python, -m, jobs.build_prefixes, --config, /etc/sapd/config.yaml]
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}

{{- define "sapd.teacherScoresJob" -}}
{{- $c := dict "root" .root "component" "teacher-scores" "job" .root.Values.teacherScores "shm" "8Gi" "round" .round }}
{{- $workers := int .root.Values.teacherScores.parallelism }}
# Indexed Job: pod i of `workers` is precompute worker i (JOB_COMPLETION_INDEX); a retried index redoes
# only its own uncommitted part.
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  completionMode: Indexed
  completions: {{ $workers }}
  parallelism: {{ $workers }}
  {{- include "sapd.batchFields" $c | nindent 2 }}
  template:
    metadata:
      labels:
        {{- include "sapd.selectorLabels" $c | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: teacher-scores
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          command: [python, -m, jobs.teacher_scores, --config, /etc/sapd/config.yaml, --round, {{ .round | quote }}]
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}

{{- define "sapd.trainJob" -}}
{{- $c := dict "root" .root "component" "train" "job" .root.Values.train "shm" .root.Values.train.shmSize "round" .round }}
{{- $svc := include "sapd.name" (dict "root" .root "component" "train") }}
{{- $name := include "sapd.stageName" $c }}
{{- $nodes := int .root.Values.train.parallelism }}
# Indexed Job of `parallelism` pods running torchrun: node rank = completion index; the rendezvous is
# pod 0 (hostname <job>-0) through the headless Service. Any failed pod fails the torchrun group, so a
# retry restarts the round from the last committed checkpoint.
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  completionMode: Indexed
  completions: {{ $nodes }}
  parallelism: {{ $nodes }}
  {{- include "sapd.batchFields" $c | nindent 2 }}
  template:
    metadata:
      labels:
        {{- include "sapd.selectorLabels" $c | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      subdomain: {{ $svc }}
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: train
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          command:
            - torchrun
            - --nnodes={{ $nodes }}
            - --nproc-per-node={{ int .root.Values.train.procsPerPod }}
            - --node-rank=$(NODE_RANK)
            - --master-addr={{ $name }}-0.{{ $svc }}
            - --master-port={{ int .root.Values.train.rendezvousPort }}
            - -m
            - jobs.train
            - --config
            - /etc/sapd/config.yaml
            - --round
            - {{ .round | quote }}
          ports:
            - name: rendezvous
              containerPort: {{ int .root.Values.train.rendezvousPort }}
            - name: metrics
              containerPort: {{ int .root.Values.train.metricsPort }}
          env:
            {{- include "sapd.env" $c | nindent 12 }}
            - name: NODE_RANK
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
            - name: SAPD_METRICS_PORT
              value: {{ .root.Values.train.metricsPort | quote }}
{{- end -}}

{{- define "sapd.trainService" -}}
{{- $c := dict "root" .root "component" "train" }}
# Headless Service: gives every train pod a DNS name (<job>-<index>.<service>) so torchrun on each pod
# reaches the rendezvous on pod 0, and Prometheus finds rank 0's /metrics.
apiVersion: v1
kind: Service
metadata:
  name: {{ include "sapd.name" $c }}
  labels:
    {{- include "sapd.labels" $c | nindent 4 }}
spec:
  clusterIP: None
  # pods must resolve each other before any is Ready: rendezvous happens during startup
  publishNotReadyAddresses: true
  selector:
    {{- include "sapd.selectorLabels" $c | nindent 4 }}
  ports:
    - name: rendezvous
      port: {{ int .root.Values.train.rendezvousPort }}
      targetPort: rendezvous
    - name: metrics
      port: {{ int .root.Values.train.metricsPort }}
      targetPort: metrics
{{- end -}}

{{- define "sapd.evaluateJob" -}}
{{- $c := dict "root" .root "component" "evaluate" "job" .root.Values.evaluate "round" .round }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | nindent 2 }}
  template:
    metadata:
      labels:
        {{- include "sapd.selectorLabels" $c | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: evaluate
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          command: [python, -m, jobs.evaluate, --config, /etc/sapd/config.yaml]
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}
